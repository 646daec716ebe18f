"""Measured cost curves and acceptance of the planner's candidate levels.

A level's cost at context length c and width w is the median time of one
forward of w tokens through its model, over its long cache of a c-token book
prompt (read-only context, as in decoding) and a recent cache: exactly the
forward a level runs in a round (logits included). Levels are named as in
the --levels grammar:

  target                    the target over its full cache
  retrieval:B               the target over a B-slot retrieval cache (TriForce's)
  self:K                    the target's first K layers over their full cache
  draft                     a draft model over its full cache
  draft@streaming:SxW       a draft model over a StreamingLLM cache of S sinks and W recent tokens

Acceptance is measured between pairs of levels on a continuation of the
prompt (`pair_acceptance`). Profiles are JSON, reused while the key (model, draft, machine, jax version)
is the same (`cached`).
"""

from __future__ import annotations

import json
import pathlib
import platform
import re
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache
from hitree_jax.decode import engine
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.drafters import round_attend
from hitree_jax.decode.programs import Programs
from hitree_jax.decode.sampling import probabilities
from hitree_jax.model.vocab import spread_probs
from hitree_jax.train.metrics import PROFILE_RANKS
from hitree_jax.model.llama import forward

RECENT_SLOTS = 32   # a level's recent cache in decoding (engine.MIN_RECENT_SLOTS)
CHUNK = 8           # retrieval chunk (the launchers')


def median_seconds(fn: Callable, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compiles and warms up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _timed_forward(config):
  @jax.jit
  def run(params, tokens, long):
    w = tokens.shape[1]
    recent = KVCache.init(config, tokens.shape[0], RECENT_SLOTS, long.keys[0].dtype)
    positions = long.next_positions[:, None] + jnp.arange(w)[None, :]
    attend = round_attend(recent.lengths, RECENT_SLOTS, jnp.tril(jnp.ones((w, w), bool)))
    logits, _, _ = forward(params, config, tokens, positions, recent, attend, context=(long,))
    return logits
  return run


def _first_layers(params, cache: KVCache, k: int):
  kept = {name: value for name, value in params.items()
          if not name.startswith("layers_") or int(name.split("_")[1]) < k}
  return kept, cache.replace(keys=cache.keys[:k], values=cache.values[:k])


class _Levels:
  """Each named level's (config, params, long cache, draft vocabulary or None) after a prompt."""

  def __init__(self, target, draft, prompt: Sequence[int], extra: int):
    self.target, self.draft, self.prompt = target, draft, list(prompt)
    self.slots = prefill_lib.cache_slots(len(prompt), extra, extra=RECENT_SLOTS)
    self.programs = Programs()
    c = target.config
    _, self.full = prefill_lib.prefill(target.params, c, KVCache.init(c, 1, self.slots),
                                       prefill_lib.make_batch([self.prompt], c, 1), self.programs)
    self._draft_full = None

  def draft_full(self, name: str):
    if self.draft is None:
      raise ValueError(f"level {name!r} needs a draft model")
    if self._draft_full is None:
      d = self.draft
      ids = self.prompt if d.vocab is None else d.vocab.to_draft(self.prompt).tolist()
      _, self._draft_full = prefill_lib.prefill(d.params, d.config, KVCache.init(d.config, 1, self.slots),
                                                prefill_lib.make_batch([ids], d.config, 1), self.programs)
    return self._draft_full

  def __getitem__(self, name: str):
    t = self.target
    if name == "target":
      return t.config, t.params, self.full, None
    if m := re.fullmatch(r"retrieval:(\d+)", name):
      last = jnp.asarray([self.prompt[-1]], jnp.int32)
      return t.config, t.params, engine._retrieval(t.params, t.config, self.full, last, int(m.group(1)), CHUNK,
                                                   self.slots - len(self.prompt), 1), None
    if m := re.fullmatch(r"self:(\d+)", name):
      k = int(m.group(1))
      return (t.config.replace(num_layers=k), *_first_layers(t.params, self.full, k), None)
    if m := re.fullmatch(r"draft(?:@streaming:(\d+)x(\d+))?", name):
      full = self.draft_full(name)
      long = full if m.group(1) is None else engine._streaming(full, int(m.group(1)), int(m.group(2)), None)
      return self.draft.config, self.draft.params, long, self.draft.vocab
    raise ValueError(f"unknown level {name!r}: expected target, retrieval:B, self:K, draft or "
                     "draft@streaming:SxW")


def level_costs(target, draft, names: Sequence[str], prompt: Sequence[int], widths: Sequence[int],
                repeats: int = 10) -> dict:
  """{level name: {width: seconds}} at the context of `prompt` (token ids of the target).
  target, draft: loading.LoadedModel (draft may be None when no name needs one)."""
  levels = _Levels(target, draft, prompt, 0)
  out = {}
  for name in names:
    config, params, long, _ = levels[name]
    run = _timed_forward(config)
    out[name] = {w: median_seconds(run, params, jnp.zeros((1, w), jnp.int32), long, repeats=repeats)
                 for w in widths}
  return out


def _continuation_probs(config, params, long, vocab, tokens, target_vocab: int, sampling):
  """The level's sampling distribution [N, V_target] and its top-R tokens [N, R] (target ids) at
  each of the N continuation tokens, teacher-forced in one chunk over its long cache."""
  ids = jnp.asarray(tokens if vocab is None else vocab.to_draft(np.asarray(tokens)), jnp.int32)[None]
  n = ids.shape[1]
  recent = KVCache.init(config, 1, n, long.keys[0].dtype)
  positions = long.next_positions[:, None] + jnp.arange(n)[None, :]
  logits, _, _ = forward(params, config, ids, positions, recent, jnp.tril(jnp.ones((n, n), bool))[None],
                         context=(long,))
  ranked = jax.lax.top_k(logits[0], PROFILE_RANKS)[1]
  probs = probabilities(logits[0], sampling)
  if vocab is None:
    return probs, ranked
  target_ids = jnp.asarray(vocab.target_ids)
  return spread_probs(probs, target_ids, target_vocab), target_ids[ranked]


def pair_acceptance(target, draft, pairs: Sequence[tuple[str, str]], prompt: Sequence[int],
                    continuation: Sequence[int], sampling) -> dict:
  """{"verifier<-proposer": acceptance} over a continuation of `prompt` (the target's own, as a
  stack meets it), each level over its own caches of the prompt. Per pair: `alpha`, the expected
  acceptance of one proposed token, E sum_x min(p, q) (Leviathan et al.); `greedy`, how often the
  proposer's top token is the verifier's; `profile`, Sequoia's per-rank acceptance of the
  proposer's top-R tokens, p(x_r) (train/metrics.py); `greedy_profile`, the same for a greedy
  verifier. The continuation runs as one chunk, so a StreamingLLM window holds it all (the
  window slides token by token in decoding): an approximation for continuations much shorter
  than the window."""
  levels = _Levels(target, draft, prompt, len(continuation))
  vocab_size = target.config.vocab_size
  dists = {}
  for name in {n for pair in pairs for n in pair}:
    dists[name] = _continuation_probs(*levels[name], list(continuation), vocab_size, sampling)
  out = {}
  for verifier, proposer in pairs:
    p, _ = dists[verifier]
    q, ranked = dists[proposer]
    hits = ranked == jnp.argmax(p, axis=-1)[:, None]
    out[f"{verifier}<-{proposer}"] = {
        "alpha": float(jnp.sum(jnp.minimum(p, q), axis=-1).mean()),
        "greedy": float(hits[:, 0].mean()),
        "profile": np.asarray(jnp.take_along_axis(p, ranked, axis=-1).mean(axis=0)).tolist(),
        "greedy_profile": np.asarray(hits.mean(axis=0)).tolist()}
  return out


def profile_key(model: str, draft: str | None) -> dict:
  """What a profile is valid for: the models, the machine and the jax that measured it."""
  return {"model": model, "draft": draft, "machine": platform.machine(), "processor": platform.processor(),
          "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()[:1]],
          "jax": jax.__version__}


def cached(path: str | pathlib.Path, key: dict, measure: Callable[[], dict]) -> dict:
  """The profile stored at `path` if it was measured for `key`, else measure() stored there."""
  path = pathlib.Path(path)
  if path.exists():
    stored = json.loads(path.read_text())
    if stored.get("key") == key:
      return stored["profile"]
  profile = measure()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"key": key, "profile": profile}, indent=1))
  return json.loads(path.read_text())["profile"]   # as a reader sees it (JSON keys are strings)
