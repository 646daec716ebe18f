"""How good a draft is for its target, measured on held-out text.

  greedy agreement:    fraction of positions where the draft's argmax is the
                       target's (what a greedy chain accepts token by token).
  expected acceptance: E_x~q[min(1, p(x)/q(x))] = sum_x min(p(x), q(x)) with p
                       and q after the sampling settings (temperature, top-k,
                       top-p): the chance that speculative sampling accepts one
                       drafted token (Leviathan et al. 2023, the alpha of a chain).
  acceptance profile:  for children drawn deterministically (the draft's top-k),
                       the chance that the rank-r child is the accepted one.
                       Verification tries x_1, x_2, ... in order and removes each
                       rejected token from p, so that chance is exactly p(x_r):
                       Sequoia's positional acceptance vector (tree.from_acceptance).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.decode.sampling import SamplingParams, probabilities
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.vocab import ReducedVocab, spread_probs
from hitree_jax.train.distill import draft_logits
from hitree_jax.train.teacher import full_sequence, full_sequence_logits


PROFILE_RANKS = 8


def position_metrics(target_logits, draft_probs_full, draft_ranked, sampling: SamplingParams):
  """Per position: (greedy agreement [..] bool, expected acceptance [..], profile [.., R],
  greedy profile [.., R]: the profile when the target decodes greedily, p one-hot).

  target_logits [..., V]; draft_probs_full [..., V] the draft's sampling distribution in target
  ids; draft_ranked [..., R] the draft's top-R tokens by logit (its deterministic children, as
  drafters.draw_children ranks them) as target ids."""
  p = probabilities(target_logits, sampling)
  hits = draft_ranked == jnp.argmax(target_logits, axis=-1)[..., None]
  profile = jnp.take_along_axis(p, draft_ranked, axis=-1)
  return hits[..., 0], jnp.sum(jnp.minimum(p, draft_probs_full), axis=-1), profile, hits


def draft_metrics(target_logits, logits, target_ids, target_vocab_size: int, sampling):
  """position_metrics of a draft's logits [..., V'] over its ids (target_ids [V'] maps them to the
  target's, OTHER first; None: the target's own vocabulary)."""
  q = probabilities(logits, sampling)
  ranked = jax.lax.top_k(logits, PROFILE_RANKS)[1]
  if target_ids is not None:
    q, ranked = spread_probs(q, target_ids, target_vocab_size), target_ids[ranked]
  return position_metrics(target_logits, q, ranked, sampling)


@functools.partial(jax.jit, static_argnums=(1, 3, 7))
def _window_metrics(target_params, target_config: ModelConfig, draft_params, draft_config: ModelConfig,
                    target_tokens, target_ids, draft_ids, target_vocab_size: int, sampling):
  target = full_sequence_logits(target_params, target_config, target_tokens)
  if target_ids is None:  # the draft shares the target's vocabulary
    logits = full_sequence_logits(draft_params, draft_config, target_tokens)
  else:
    logits = draft_logits(draft_params, draft_config, draft_ids[target_tokens])
  return draft_metrics(target, logits, target_ids, target_vocab_size, sampling)


def evaluate_draft(target, draft, vocab: ReducedVocab | None, windows: np.ndarray,
                   sampling: SamplingParams, batch: int = 4) -> dict:
  """Greedy agreement and expected acceptance of a draft over every position of windows [N, T].

  target / draft: LoadedModel-like (config, params); vocab: the draft's subset, or None."""
  agree, accept, profile, greedy_profile = [], [], [], []
  ids = table = None
  if vocab is not None:
    ids, table = jnp.asarray(vocab.target_ids), jnp.asarray(vocab.draft_ids)
  for i in range(0, len(windows), batch):
    a, e, r, g = _window_metrics(target.params, target.config, draft.params, draft.config,
                              jnp.asarray(windows[i:i + batch]), ids, table,
                              target.config.vocab_size, sampling)
    agree.append(np.asarray(a).ravel())
    accept.append(np.asarray(e).ravel())
    profile.append(np.asarray(r).reshape(-1, PROFILE_RANKS))
    greedy_profile.append(np.asarray(g).reshape(-1, PROFILE_RANKS))
  return {"greedy_agreement": float(np.mean(np.concatenate(agree))),
          "expected_acceptance": float(np.mean(np.concatenate(accept))),
          "acceptance_profile": np.concatenate(profile).mean(0).round(5).tolist(),
          "greedy_acceptance_profile": np.concatenate(greedy_profile).mean(0).round(5).tolist(),
          "positions": int(sum(len(a) for a in agree)),
          "vocab_coverage": 1.0 if vocab is None else vocab.coverage(windows)}


@functools.partial(jax.jit, static_argnums=(1, 3, 7))
def _eagle_window_metrics(target_params, target_config: ModelConfig, eagle_params, eagle_config: ModelConfig,
                          tokens, target_ids, sampling, taps: tuple[int, ...]):
  from hitree_jax.heads import eagle
  from hitree_jax.train.heads import two_passes
  target, hidden = full_sequence(target_params, target_config, tokens, taps)
  embedding = target_params["embed_tokens"]["embedding"]
  out = []
  for predicted in two_passes(eagle_params, eagle_config, embedding, tokens, hidden):
    logits = eagle.logits(eagle_params, predicted, target_ids is not None)
    out.append(draft_metrics(target, logits, target_ids, target_config.vocab_size, sampling))
  return out


def evaluate_eagle(target, eagle_params, eagle_config: ModelConfig, vocab: ReducedVocab | None,
                   windows: np.ndarray, sampling: SamplingParams, batch: int = 4,
                   taps: tuple[int, ...] = ()) -> dict:
  """evaluate_draft's figures for an EAGLE feature draft reading the target's true features
  (a depth-1 node; with taps, those layers' too), and its agreement and acceptance when it reads
  its own predicted ones (a depth-2 node: `depth2_*`)."""
  ids = None if vocab is None else jnp.asarray(vocab.target_ids)
  parts = [[], []]
  for i in range(0, len(windows), batch):
    for store, metrics in zip(parts, _eagle_window_metrics(target.params, target.config, eagle_params,
                                                            eagle_config, jnp.asarray(windows[i:i + batch]),
                                                            ids, sampling, tuple(taps))):
      store.append([np.asarray(m) for m in metrics])
  (a1, e1, r1, g1), (a2, e2, _, _) = [[np.concatenate([m[k].reshape(-1, *m[k].shape[2:]) for m in store])
                                       for k in range(4)] for store in parts]
  return {"greedy_agreement": float(a1.mean()), "expected_acceptance": float(e1.mean()),
          "acceptance_profile": r1.mean(0).round(5).tolist(),
          "greedy_acceptance_profile": g1.mean(0).round(5).tolist(),
          "depth2_greedy_agreement": float(a2.mean()), "depth2_expected_acceptance": float(e2.mean()),
          "positions": int(a1.size), "vocab_coverage": 1.0 if vocab is None else vocab.coverage(windows)}


@functools.partial(jax.jit, static_argnums=(1,))
def _medusa_window_metrics(target_params, target_config: ModelConfig, medusa_params, tokens, target_ids,
                           sampling):
  from hitree_jax.heads import medusa
  target, hidden = full_sequence(target_params, target_config, tokens)
  logits = medusa.logits(medusa_params, hidden, target_ids is not None)     # [B, T, K, V']
  out = []
  for h in range(logits.shape[2]):  # head h + 1 at position i guesses what the target says at i + h + 1
    k = h + 1
    hits, accept, _, _ = draft_metrics(target[:, k:], logits[:, :-k, h], target_ids, target_config.vocab_size,
                                       sampling)
    out.append((jnp.mean(hits), jnp.mean(accept)))
  return out


def evaluate_medusa(target, medusa_params, vocab: ReducedVocab | None, windows: np.ndarray,
                    sampling: SamplingParams, batch: int = 4) -> dict:
  """Per head k: how often its top-1 is the target's greedy token k places past the root, and its
  expected acceptance there (reading the target's true feature, as it always does)."""
  ids = None if vocab is None else jnp.asarray(vocab.target_ids)
  per_batch = [_medusa_window_metrics(target.params, target.config, medusa_params,
                                      jnp.asarray(windows[i:i + batch]), ids, sampling)
               for i in range(0, len(windows), batch)]
  heads = len(per_batch[0])
  mean = lambda j, h: float(np.mean([float(b[h][j]) for b in per_batch]))
  return {"greedy_agreement_per_head": [round(mean(0, h), 5) for h in range(heads)],
          "expected_acceptance_per_head": [round(mean(1, h), 5) for h in range(heads)],
          "greedy_agreement": mean(0, 0), "expected_acceptance": mean(1, 0),
          "vocab_coverage": 1.0 if vocab is None else vocab.coverage(windows)}


@functools.partial(jax.jit, static_argnums=(1, 3, 4, 8, 9))
def _chain_window_metrics(target_params, target_config: ModelConfig, draft_params, net, draft_config: ModelConfig,
                          tokens, target_ids, sampling, taps: tuple[int, ...], steps: int):
  from hitree_jax.train.eagle3 import chain_logits
  target, hidden = full_sequence(target_params, target_config, tokens, taps)
  embedding = target_params["embed_tokens"]["embedding"]
  out = []
  for k, logits in enumerate(chain_logits(net, draft_params, draft_config, embedding, tokens, hidden, steps,
                                          target_ids is not None)):
    logits = logits[:, :tokens.shape[1] - k]     # step k at p guesses x_{p+k+1}, the target's at p + k
    out.append(draft_metrics(target[:, k:], logits, target_ids, target_config.vocab_size, sampling))
  return out


def evaluate_chain(target, draft_params, net, draft_config: ModelConfig, vocab: ReducedVocab | None,
                   windows: np.ndarray, sampling: SamplingParams, taps: tuple[int, ...], steps: int = 3,
                   batch: int = 4) -> dict:
  """evaluate_draft's figures for an EAGLE-3 draft (train/eagle3.py's chains, the true tokens fed
  in) at depth 1, and its greedy agreement and expected acceptance at each depth of the chain
  (`*_per_depth`): depth d reads the states the draft made at depth d-1."""
  ids = None if vocab is None else jnp.asarray(vocab.target_ids)
  parts = [[] for _ in range(steps)]
  for i in range(0, len(windows), batch):
    for store, metrics in zip(parts, _chain_window_metrics(target.params, target.config, draft_params, net,
                                                            draft_config, jnp.asarray(windows[i:i + batch]), ids,
                                                            sampling, tuple(taps), steps)):
      store.append([np.asarray(m).reshape(-1, *np.shape(m)[2:]) for m in metrics])
  depths = [[np.concatenate([m[j] for m in store]) for j in range(4)] for store in parts]
  (a1, e1, r1, g1) = depths[0]
  return {"greedy_agreement": float(a1.mean()), "expected_acceptance": float(e1.mean()),
          "acceptance_profile": r1.mean(0).round(5).tolist(),
          "greedy_acceptance_profile": g1.mean(0).round(5).tolist(),
          "greedy_agreement_per_depth": [round(float(d[0].mean()), 5) for d in depths],
          "expected_acceptance_per_depth": [round(float(d[1].mean()), 5) for d in depths],
          "positions": int(a1.size), "vocab_coverage": 1.0 if vocab is None else vocab.coverage(windows)}


@functools.partial(jax.jit, static_argnums=(1, 3, 4, 8))
def _block_window_metrics(target_params, target_config: ModelConfig, draft_params, draft_config: ModelConfig,
                          spec, tokens, at, sampling, taps: tuple[int, ...]):
  from hitree_jax.train.dflash import anchor_logits, block_labels
  target, hidden = full_sequence(target_params, target_config, tokens, taps)
  features = hidden[..., :len(taps) * target_config.hidden_size]
  logits = anchor_logits(draft_params, draft_config, spec, target_params["embed_tokens"]["embedding"], tokens,
                         features, at)                                        # [W, A, B-1, V]
  target = block_labels(target, at, spec.block_size)                        # row d: the target's at a+d-1
  hits, accept, _, _ = draft_metrics(target, logits, None, target_config.vocab_size, sampling)
  accepted = jnp.sum(jnp.cumprod(hits, axis=-1), axis=-1)                   # a greedy chain's accepted rows
  return hits, accept, accepted


def evaluate_block(target, draft_params, draft_config: ModelConfig, spec, windows: np.ndarray,
                   sampling: SamplingParams, stride: int = 4, batch: int = 2) -> dict:
  """A DFlash draft's blocks rooted every `stride` positions of windows [N, T] (the true tokens
  before each root): per row, its greedy agreement with the target and its expected acceptance;
  and the rows a greedy chain of the block accepts on average (`greedy_block_accepted`)."""
  t = windows.shape[1]
  at = np.arange(0, t - spec.block_size + 1, stride, dtype=np.int32)
  hits, accept, accepted = [], [], []
  for i in range(0, len(windows), batch):
    chunk = jnp.asarray(windows[i:i + batch])
    h, e, a = _block_window_metrics(target.params, target.config, draft_params, draft_config, spec, chunk,
                                    jnp.broadcast_to(at, (len(chunk), at.size)), sampling, spec.target_layer_ids)
    hits.append(np.asarray(h).reshape(-1, spec.block_size - 1))
    accept.append(np.asarray(e).reshape(-1, spec.block_size - 1))
    accepted.append(np.asarray(a).ravel())
  hits, accept = np.concatenate(hits), np.concatenate(accept)
  return {"greedy_agreement": float(hits[:, 0].mean()), "expected_acceptance": float(accept[:, 0].mean()),
          "greedy_agreement_per_depth": hits.mean(0, dtype=np.float64).round(5).tolist(),
          "expected_acceptance_per_depth": accept.mean(0, dtype=np.float64).round(5).tolist(),
          "greedy_block_accepted": float(np.concatenate(accepted).mean()), "blocks": int(hits.shape[0])}
