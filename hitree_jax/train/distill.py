"""Distil a small draft from a target: data, student, loss, train loop (optax + orbax).

Pipeline (launch/distill.py drives it):
  1. `prepare_labels`: token windows from the training books and the teacher's
     top-k next-token log-probabilities at every position, cached in workdir.
  2. `student_from_teacher`: a Llama with a few of the teacher's layers and a
     reduced vocabulary (vocab.py), initialised from the teacher's weights.
  3. `train`: cross-entropy to the teacher's (renormalised top-k) distribution,
     AdamW with warmup + cosine decay, a jitted step, an orbax CheckpointManager
     so an interrupted run resumes at the step it stopped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging

from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.vocab import OTHER, ReducedVocab, mask_other
from hitree_jax.train import corpus, instructions, teacher

# progress(done, total, detail): called with done=0 as a loop starts, then after each unit of it.
# Launchers turn it into log lines with an ETA; the library only counts.
ProgressFn = Callable[[int, int, str], None]


def prepare_labels(workdir: pathlib.Path, split: str, teacher_model, tokenizer, *, window: int,
                   n_windows: int, k: int, progress: ProgressFn | None = None,
                   features: bool = False, own_text=None, taps: tuple[int, ...] = (),
                   chat: bool = False, teacher_key: str = "") -> dict:
  """{'tokens' [N,T], 'ids' [N,T,k], 'log_probs' [N,T,k]} for a split, computed once per workdir;
  with features also 'features' [N,T,E] (the teacher's hidden states, float16; with taps
  [N,T,(len(taps)+1)E], those layers' states first: heads/eagle.py).
  own_text: (prompt tokens, SamplingParams): each window keeps that many book tokens and the
  rest is the teacher's own sampled continuation (teacher.own_continuations), cached too.
  chat: those first tokens are an instruction over a passage in the chat template instead
  (train/instructions.py), and the rest the teacher's answer; own_text is then required.
  teacher_key: what the teacher holds (loading/digest.py), in the files' names: another teacher's
  labels in the same workdir are never taken for this one's."""
  if chat and own_text is None:
    raise UsageError("chat windows need own_text: the teacher writes their answers")
  text = "" if own_text is None else (f"_{'chat' if chat else 'own'}{own_text[0]}"
                                      f"_t{float(own_text[1].temperature):g}_p{float(own_text[1].top_p):g}")
  keyed = f"{teacher_key}_" if teacher_key else ""
  named = lambda with_features: (f"labels_{keyed}{split}_{n_windows}x{window}_top{k}"
                                 + ("_features" if with_features else "") + taps_suffix(taps) + text)
  name = named(features)
  path = pathlib.Path(workdir) / f"{name}.npz"
  if path.is_file():
    with np.load(path) as f:
      return dict(f)
  superset = path.with_name(f"{named(True)}.npz")   # a feature draft's labels hold a token draft's
  if not features and not taps and superset.is_file():
    with np.load(superset) as f:
      return {key: f[key] for key in f.files if key != "features"}
  if chat:
    windows, _ = instructions.chat_windows(tokenizer, split, window, n_windows, own_text[0])
  else:
    windows = corpus.token_windows(tokenizer, split, window, n_windows)
  if own_text is not None:
    text_path = _teachers_text(path.parent, f"labels_{keyed}{split}_{n_windows}x{window}", text)
    if not text_path.is_file():
      logging.info("the teacher continues %d %s windows after %d %s tokens", n_windows, split, own_text[0],
                   "instruction" if chat else "book")
      path.parent.mkdir(parents=True, exist_ok=True)
      np.save(text_path, teacher.own_continuations(teacher_model.params, teacher_model.config, windows,
                                                   own_text[0], own_text[1], progress=progress))
    windows = np.load(text_path)
  logging.info("labelling %d %s windows of %d tokens with the teacher's top-%d", n_windows, split,
               window, k)
  return label_windows(path, windows, teacher_model.params, teacher_model.config, k,
                       progress=progress, features=features, taps=taps)


def _teachers_text(workdir: pathlib.Path, windows: str, text: str) -> pathlib.Path:
  """Where the teacher's own text for these windows is kept: one file whatever is labelled on it
  (top-k, features, taps), so a second kind of draft in the workdir does not make the teacher
  write it again; the file an earlier version kept beside one kind's labels serves too."""
  path = workdir / f"{windows}{text}_text.npy"
  older = sorted(workdir.glob(f"{windows}_top*{text}_text.npy"))
  return older[0] if not path.is_file() and older else path


def taps_suffix(taps) -> str:
  """'_taps2-15-27' for taps (2, 15, 27), '' for none: names what was labelled or trained with them."""
  return "_taps" + "-".join(map(str, taps)) if taps else ""


def label_windows(path: pathlib.Path, windows: np.ndarray, params, config: ModelConfig, k: int,
                  chunk: int = 64, progress: ProgressFn | None = None, features: bool = False,
                  taps: tuple[int, ...] = ()) -> dict:
  """Labels windows [N, T] with the teacher's top-k (and features) and saves them at path.

  Labelling is the slow part of distillation (the teacher runs at ~190 tokens/s on two cores), so
  each `chunk` of windows is saved as it is done and a rerun after an interruption labels only
  the chunks that are missing; the parts are merged into `path` at the end."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  parts = [path.with_name(f"{path.stem}.part{i:05d}.npz") for i in range(-(-len(windows) // chunk))]
  todo = [i for i, part in enumerate(parts) if not part.is_file()]
  if progress:
    progress(0, len(todo), "")
  for done, i in enumerate(todo, 1):
    start = i * chunk
    ids, log_probs, *hidden = teacher.teacher_topk(params, config, windows[start:start + chunk], k,
                                                   features=features, taps=taps)
    _save_npz(parts[i], ids=ids, log_probs=log_probs.astype(np.float16),
              **({"features": hidden[0]} if features else {}))
    detail = f"labelled windows {start}-{start + len(ids)} of {len(windows)}"
    if progress:
      progress(done, len(todo), detail)
    else:
      logging.info("%s", detail)
  with contextlib.ExitStack() as stack:
    loaded = [stack.enter_context(np.load(part)) for part in parts]
    labels = {"tokens": windows, **{key: np.concatenate([f[key] for f in loaded])
                                    for key in loaded[0].files}}
  _save_npz(path, **labels)
  for part in parts:
    part.unlink()
  return labels


def _save_npz(path: pathlib.Path, **arrays):
  """Writes then renames, so an interrupted save never leaves a truncated file under path."""
  tmp = path.with_name(path.stem + ".tmp.npz")
  np.savez(tmp, **arrays)
  tmp.rename(path)


# --- the student ---

def student_from_teacher(teacher_params, teacher_config: ModelConfig, layers: Sequence[int],
                         vocab: ReducedVocab) -> tuple[ModelConfig, dict]:
  """A draft made of the teacher's `layers` (in that order), final norm and the rows of its
  embedding (and head) for the reduced vocabulary; OTHER starts as the mean embedding."""
  if not layers or min(layers) < 0 or max(layers) >= teacher_config.num_layers:
    raise UsageError(f"student layers {tuple(layers)} must be teacher layers in "
                     f"[0, {teacher_config.num_layers})")
  if vocab.target_vocab_size != teacher_config.vocab_size:
    raise UsageError(f"the reduced vocabulary maps onto {vocab.target_vocab_size} tokens, the "
                     f"teacher has {teacher_config.vocab_size}")
  to_draft = lambda i: None if i is None else int(vocab.draft_ids[i]) or None
  config = teacher_config.replace(num_layers=len(layers), vocab_size=vocab.size,
                                  bos_token_id=to_draft(teacher_config.bos_token_id),
                                  eos_token_id=to_draft(teacher_config.eos_token_id))
  rows = np.maximum(vocab.target_ids, 0)
  embedding = np.asarray(teacher_params["embed_tokens"]["embedding"])[rows]
  embedding[OTHER] = embedding[1:].mean(axis=0)
  params = {"embed_tokens": {"embedding": embedding}, "norm": teacher_params["norm"]}
  for i, layer in enumerate(layers):
    params[f"layers_{i}"] = teacher_params[f"layers_{layer}"]
  if not teacher_config.tie_word_embeddings:
    params["lm_head"] = {"kernel": np.asarray(teacher_params["lm_head"]["kernel"])[:, rows]}
  return config, jax.tree.map(jnp.asarray, params)


def sparse_targets(ids: np.ndarray, log_probs: np.ndarray, vocab: ReducedVocab):
  """Teacher top-k (target ids, log-probs) -> (draft ids, probs renormalised over the subset).

  Top-k tokens outside the subset get probability 0 (the draft cannot propose them)."""
  draft_ids = vocab.to_draft(ids)
  probs = np.where(draft_ids != OTHER, np.exp(log_probs.astype(np.float32)), 0.0)
  probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-9)
  return draft_ids.astype(np.int32), probs.astype(np.float32)


def draft_logits(params, config: ModelConfig, tokens):
  """[B, T, V'] logits of a reduced-vocabulary draft with OTHER masked (never proposed)."""
  logits = teacher.full_sequence_logits(params, config, tokens)
  return mask_other(logits)


def loss_fn(params, config: ModelConfig, tokens, target_ids, target_probs):
  """Cross-entropy to the teacher's renormalised top-k (= KL up to the teacher's entropy).

  tokens [B, T] draft ids; target_ids / target_probs [B, T, k]. Returns (loss, top-1 agreement)."""
  log_q = jax.nn.log_softmax(draft_logits(params, config, tokens), axis=-1)
  picked = jnp.take_along_axis(log_q, target_ids, axis=-1)
  loss = -jnp.sum(jnp.where(target_probs > 0, target_probs * picked, 0.0), axis=-1).mean()
  agree = jnp.mean(jnp.argmax(log_q, axis=-1) == target_ids[..., 0])
  return loss, agree


def optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                                end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


# A training objective: loss(params, frozen, *batch arrays) -> (loss, top-1 agreement); `frozen`
# holds arrays the student reads but does not train (e.g. a feature draft's embedding and head).
Objective = Callable[..., tuple[jax.Array, jax.Array]]


@functools.lru_cache(maxsize=None)
def draft_objective(config: ModelConfig) -> Objective:
  """loss_fn for a draft model of this config (one object per config: a jit-static argument)."""
  return lambda params, frozen, tokens, ids, probs: loss_fn(params, config, tokens, ids, probs)


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=(0,))
def train_step(state, objective: Objective, tx: optax.GradientTransformation, frozen, *batch):
  (loss, agree), grads = jax.value_and_grad(objective, has_aux=True)(state["params"], frozen, *batch)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss, agree


@functools.partial(jax.jit, static_argnums=(1,))
def eval_step(params, objective: Objective, frozen, *batch):
  return objective(params, frozen, *batch)


def batch_indices(n_examples: int, batch: int, step: int, seed: int) -> np.ndarray:
  """The examples of a step: a function of (seed, step) only, so a resumed run sees the same data."""
  per_epoch = n_examples // batch
  epoch, i = divmod(step, per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(n_examples)
  return order[i * batch:(i + 1) * batch]


def evaluate_loss(params, objective: Objective, data, batch: int, frozen=None) -> tuple[float, float]:
  losses, agrees, sizes = [], [], []
  for i in range(0, len(data[0]), batch):  # a shorter last batch compiles once more
    loss, agree = eval_step(params, objective, frozen, *(jnp.asarray(x[i:i + batch]) for x in data))
    losses.append(float(loss))
    agrees.append(float(agree))
    sizes.append(len(data[0][i:i + batch]))
  return float(np.average(losses, weights=sizes)), float(np.average(agrees, weights=sizes))


SETTINGS = "settings.json"


def check_settings(workdir: pathlib.Path, settings: dict, record: bool = True) -> None:
  """Records a new run's settings in workdir (unless not `record`: a call that trains nothing,
  e.g. one that only labels), or refuses to resume one made with others."""
  path = workdir / SETTINGS
  settings = json.loads(json.dumps(settings))  # as JSON reads them back (tuples become lists)
  if path.is_file():
    kept = json.loads(path.read_text())
    changed = {k: (kept.get(k), settings.get(k)) for k in sorted({*kept, *settings})
               if kept.get(k) != settings.get(k)}
    if changed:
      raise UsageError(f"{workdir} holds a run made with other settings (" + ", ".join(
          f"{k}: {old} there, {new} now" for k, (old, new) in changed.items()) +
          "): use another workdir, or delete it to start again")
    return
  if (workdir / "ckpt").is_dir() and any((workdir / "ckpt").iterdir()):
    raise UsageError(f"{workdir} holds checkpoints without {SETTINGS} (a run of an older version): "
                     "use another workdir, or delete it to start again")
  if record:
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1, sort_keys=True))


def train(workdir: pathlib.Path, config: ModelConfig, params, train_data, eval_data, *, steps: int,
          batch: int, lr: float, warmup: int, seed: int, save_every: int = 25,
          eval_every: int = 50, log_every: int = 5, until: int | None = None,
          progress: ProgressFn | None = None, objective: Objective | None = None, frozen=None,
          settings: dict | None = None):
  """Trains (or resumes) in workdir/ckpt; returns (params, history of logged metrics).

  objective / frozen: what is minimised (default: a draft model's loss_fn for `config`) and the
  untrained arrays it reads besides the batch.

  `until`: stop after that step (and save), e.g. to train in slices of a session (0: none);
  rerunning with the same settings continues exactly where it stopped.
  `progress`: told of each step this run takes (see ProgressFn).
  `settings`: what defines the run (e.g. its command-line flags), kept in workdir/settings.json:
  resuming a checkpoint made with other settings is refused, naming them (it would silently
  continue another run: other data, another schedule).

  train_data / eval_data: (tokens [N,T], target ids [N,T,k], target probs [N,T,k]) in draft ids.
  """
  objective = objective or draft_objective(config)
  check_settings(pathlib.Path(workdir), dict(settings or {}, steps=steps, batch=batch, lr=lr,
                                             warmup=warmup, seed=seed), record=until != 0)
  tx = optimizer(lr, steps, warmup)
  params = jax.tree.map(jnp.array, params)  # a copy: the step donates its state's buffers
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0)}
  manager = ocp.CheckpointManager(
      pathlib.Path(workdir).absolute() / "ckpt",
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=save_every))
  if manager.latest_step() is not None:
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
    logging.info("resumed from step %d", int(state["step"]))
  history = []
  start, tic = int(state["step"]), time.perf_counter()
  end = steps if until is None else min(steps, until)
  if progress:
    progress(0, max(end - start, 0), "")
  for step in range(start, end):
    idx = batch_indices(len(train_data[0]), batch, step, seed)
    state, loss, agree = train_step(state, objective, tx, frozen, *(jnp.asarray(x[idx]) for x in train_data))
    record = {"step": step + 1}
    if (step + 1) % log_every == 0 or step + 1 == steps:
      record.update(loss=float(loss), agreement=float(agree),
                    s_per_step=(time.perf_counter() - tic) / (step + 1 - start))
    if eval_data is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
      record["eval_loss"], record["eval_agreement"] = evaluate_loss(state["params"], objective,
                                                                    eval_data, batch, frozen)
    if len(record) > 1:
      logging.info("step %s", " ".join(f"{k}={v:.4g}" for k, v in record.items()))
      history.append(record)
    manager.save(step + 1, args=ocp.args.StandardSave(state), force=step + 1 == until)
    if progress:
      progress(step + 1 - start, end - start, f"step {step + 1} of {steps}")
  manager.wait_until_finished()
  manager.close()
  return state["params"], history
