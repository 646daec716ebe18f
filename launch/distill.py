"""Distil a small draft from a target, export it as a GGUF, and evaluate drafts.

Train (labels, training and export; an interrupted run resumes from workdir):
  python -m launch.distill --teacher=smollm2 --workdir=runs/draft   # writes runs/draft/draft.gguf
Train EAGLE's one-layer feature draft, or Medusa's heads, on the target's features (heads/):
  python -m launch.distill --config=configs/distill_eagle.py   # drafts/smollm2-eagle's recipe
  python -m launch.distill --kind=medusa --workdir=runs/eagle   # writes runs/eagle/medusa/
Train an EAGLE-3 draft (three teacher layers, its own head over a draft vocabulary, trained along
chains) and write it in vLLM's speculators format, which vLLM and SGLang serve as well:
  python -m launch.distill --kind=eagle3 --text=chat --workdir=runs/eagle3   # runs/eagle3/eagle3/
A DFlash block drafter (one forward proposes a block of 16), in the same format:
  python -m launch.distill --kind=dflash --text=chat --workdir=runs/eagle3   # runs/eagle3/dflash/
The export goes under the workdir unless --out names a place: no default command writes over
a shipped draft (--out=drafts/smollm2-draft.gguf does, when you mean it).
Evaluate a draft on held-out books (agreement, acceptance, cost ratio):
  python -m launch.distill --eval --draft=drafts/smollm2-draft.gguf --json

Data: token windows cut evenly from every training book of the three corpora
(held-out books in hitree_jax/train/corpus.py), labelled once with the
teacher's top-k next-token log-probabilities (cached in workdir). Every flag is
checked before the teacher loads; labelling and training log progress with an ETA.
"""

from __future__ import annotations

import functools
import json
import pathlib
import time

import numpy as np
from absl import app, flags, logging

from . import common
from .progress import Progress

common.define_config_flag()

flags.DEFINE_enum("kind", "draft", ["draft", "eagle", "eagle3", "dflash", "medusa"], "What to train: a "
                  "small draft model made of teacher layers (GGUF), or on the teacher's features (a "
                  "folder): EAGLE's feature draft, an EAGLE-3 draft or a DFlash block drafter (both "
                  "written in vLLM's speculators format), or Medusa's heads.")
flags.DEFINE_string("teacher", "smollm2", "The target model to imitate (any --model spec).")
flags.DEFINE_string("workdir", "runs/draft", "Labels, orbax checkpoints and logs (resumable).")
flags.DEFINE_string("out", None, "Where the trained draft is written: a GGUF (--kind=draft) or a "
                    "folder (eagle, eagle3, dflash, medusa); by default WORKDIR/draft.gguf or WORKDIR/KIND, never "
                    "over a shipped draft.")
flags.DEFINE_list("layers", ["0", "1", "29"], "--kind=draft: teacher layers the student starts from, in order.")
flags.DEFINE_integer("vocab_size", 8192, "Draft vocabulary: most frequent training tokens (+ other).")
flags.DEFINE_integer("window", 256, "Tokens per training window.")
flags.DEFINE_integer("train_windows", 1920, "Training windows (window tokens each).")
flags.DEFINE_integer("eval_windows", 32, "Held-out windows.")
flags.DEFINE_integer("topk", 32, "Teacher log-probabilities kept per position.")
flags.DEFINE_integer("steps", 800, "Optimizer steps.")
flags.DEFINE_integer("batch", 8, "Windows per step.")
flags.DEFINE_float("lr", 5e-4, "Peak learning rate (AdamW, warmup + cosine).")
flags.DEFINE_integer("warmup", 20, "Warmup steps.")
flags.DEFINE_integer("until", None, "Stop after this step (resume later with the same flags); 0 only labels.")
flags.DEFINE_integer("seed", 0, "Data order seed.")
flags.DEFINE_bool("quantize", True, "Export weight matrices as Q8_0 (else float32).")
flags.DEFINE_float("feature_weight", 1.0, "--kind=eagle: weight of the feature regression (Huber).")
flags.DEFINE_bool("unroll", True, "--kind=eagle: also train a second pass on the draft's own "
                  "predicted features (what depth-2 tree nodes read).")
flags.DEFINE_list("taps", [], "--kind=eagle: teacher layers whose outputs the draft reads beside the "
                  "final states, fused (a low, a middle and a high layer, e.g. 2,15,27); none: EAGLE's "
                  "final states only. --kind=eagle3: the layers whose outputs it reads (none: EAGLE-3's "
                  "default, the outputs of layers 1, L/2 - 1 and L - 4, i.e. the inputs of 2, L/2, L - 3). "
                  "--kind=dflash: its context (none: one per draft layer, spread from 1 to L - 3).")
flags.DEFINE_integer("block_size", 16, "--kind=dflash: the block one forward proposes (its root and "
                     "block_size - 1 guesses).")
flags.DEFINE_integer("draft_layers", 3, "--kind=dflash: the draft's layers (by default it reads as many "
                     "teacher layers, spread evenly: --taps).")
flags.DEFINE_integer("anchors", 32, "--kind=dflash: blocks trained per window, rooted at random positions.")
flags.DEFINE_integer("mask_token_id", None, "--kind=dflash: the token whose embedding fills a block (by "
                     "default the teacher's last id).")
flags.DEFINE_float("loss_gamma", 7.0, "--kind=dflash: DFlash's gamma: row d of a block weighs "
                   "exp(-(d-1)/gamma) in the loss.")
flags.DEFINE_integer("ttt_steps", 3, "--kind=eagle3: depths of the chain trained at once (EAGLE-3's "
                     "training-time test), each weighted 0.8 times the one before.")
flags.DEFINE_string("verifier", None, "--kind=eagle3|dflash: the target as the export's readers (vLLM, "
                    "speculators) load it, an HF id or folder, written into its config.json; by default "
                    "--teacher where it is an HF folder (a GGUF teacher: none).")
flags.DEFINE_integer("num_heads", 4, "--kind=medusa: heads (the deepest tree they can fill).")
flags.DEFINE_enum("text", "books", ["books", "own", "chat"], "Training text: book windows; "
                  "own: windows whose first --own_prompt_tokens are a book's and the rest the "
                  "teacher's own continuation, sampled at --temperature / --top_p (the text a draft "
                  "meets while decoding; held-out evaluation stays on books); chat: the first "
                  "--own_prompt_tokens are an instruction over a book passage in the chat template "
                  "(summarise, continue, answer, rewrite, extract, ask) and the rest the teacher's "
                  "answer, for a draft of a chat model (evaluated on the held-out books' instructions).")
flags.DEFINE_integer("own_prompt_tokens", 64, "--text=own|chat: prompt tokens before each "
                     "continuation or answer.")
flags.DEFINE_bool("eval", False, "Evaluate --draft against --teacher instead of training: on held-out "
                  "books, or with --text=chat on the held-out chat windows.")
flags.DEFINE_string("draft", None, "--eval: the draft, as --draft of launch.generate: PATH (a GGUF "
                    "from this launcher), eagle:PATH, eagle3:PATH, dflash:PATH or medusa:PATH (a --kind "
                    "folder, or a published EAGLE-3, DFlash or Medusa draft) "
                    "or self:K (the teacher's first K layers).")
flags.DEFINE_float("temperature", 0.6, "Sampling temperature of the acceptance metric (and of "
                   "--text=own's continuations).")
flags.DEFINE_float("top_p", 0.9, "Nucleus mass of the acceptance metric (and of --text=own's).")
flags.DEFINE_integer("cost_context", 512, "--eval: prompt tokens when timing a decode step.")
flags.DEFINE_bool("json", False, "Print one JSON record as the last line.")
FLAGS = flags.FLAGS


def out_path() -> pathlib.Path:
  """--out, else under the workdir: WORKDIR/draft.gguf, or the folder WORKDIR/KIND for heads."""
  if FLAGS.out:
    return pathlib.Path(FLAGS.out)
  return pathlib.Path(FLAGS.workdir) / ("draft.gguf" if FLAGS.kind == "draft" else FLAGS.kind)


def command() -> str:
  """The launch.distill command line that reproduces this training run: its --config (the
  recipe) and the training flags given beside it."""
  from ml_collections import config_flags
  recipe = ([f"--config={config_flags.get_config_filename(FLAGS['config'])}"]
            if FLAGS["config"].present else [])
  return "python -m launch.distill " + " ".join(recipe + [
      f"--{name}={flag.value if not isinstance(flag.value, list) else ','.join(flag.value)}"
      for name, flag in sorted(FLAGS.__flags.items())
      if flag.present and name in _TRAIN_FLAGS])


def own_text():
  """prepare_labels' own_text for --text=own or chat (None for books)."""
  if FLAGS.text == "books":
    return None
  from hitree_jax.decode.sampling import SamplingParams
  return FLAGS.own_prompt_tokens, SamplingParams.create(FLAGS.temperature, FLAGS.top_p)


def split_labels(teacher, tokenizer, split: str, **features) -> dict:
  """distill.prepare_labels of a split ("train" or "eval") in --workdir, with the flags' windows
  and text: own text trains only (evaluation stays on books); chat windows train and evaluate
  (a chat draft is judged on chat). features: features=True and taps for a feature draft."""
  from hitree_jax.train import distill
  chat = FLAGS.text == "chat"
  return distill.prepare_labels(pathlib.Path(FLAGS.workdir), split, teacher, tokenizer, window=FLAGS.window,
                                n_windows=FLAGS.train_windows if split == "train" else FLAGS.eval_windows,
                                k=FLAGS.topk, progress=Progress(f"labelling {split} windows").update,
                                own_text=own_text() if split == "train" or chat else None, chat=chat,
                                teacher_key=teacher_contents()[:8], **features)


@functools.cache
def teacher_contents() -> str:
  """What --teacher holds (loading/digest.py): its labels and a run's settings are keyed by it."""
  from hitree_jax.loading import resolve
  from hitree_jax.loading.digest import contents_digest
  return contents_digest(resolve(FLAGS.teacher))


def draft_vocabulary(tokenizer, teacher_config, train_tokens):
  """The --vocab_size most frequent tokens of the training text: the training books, or for a
  chat draft its windows (the template's tokens and the teacher's answers, which books lack)."""
  from hitree_jax.model.vocab import ReducedVocab
  from hitree_jax.train import corpus
  if FLAGS.text == "chat":
    counts = np.bincount(np.ravel(train_tokens), minlength=teacher_config.vocab_size)
  else:
    counts = corpus.token_counts(tokenizer, teacher_config.vocab_size)
  return ReducedVocab.most_frequent(counts, FLAGS.vocab_size)


def held_out(labels: dict) -> np.ndarray | None:
  """The windows a trained draft is evaluated on: the held-out chat windows a chat draft was
  labelled with; None (held-out books) otherwise."""
  return labels["eval"]["tokens"] if FLAGS.text == "chat" else None


def taps() -> tuple[int, ...]:
  """--taps as layer indices (check_flags has checked them); for --kind=eagle3 or dflash without
  them, its authors' default (train/eagle3.py, train/dflash.py)."""
  if FLAGS.kind == "eagle3" and not FLAGS.taps:
    from hitree_jax.train import eagle3
    return tuple(i - 1 for i in eagle3.default_aux_layers(teacher_config()))
  if FLAGS.kind == "dflash" and not FLAGS.taps:
    from hitree_jax.train import dflash
    return dflash.default_target_layers(teacher_config().num_layers, FLAGS.draft_layers)
  return tuple(int(x) for x in FLAGS.taps)


def dflash_spec():
  """--kind=dflash's block: its size, its mask token (by default the teacher's last id) and taps."""
  from hitree_jax.heads.dflash import BlockSpec
  mask = FLAGS.mask_token_id if FLAGS.mask_token_id is not None else teacher_config().vocab_size - 1
  return BlockSpec(FLAGS.block_size, mask, taps())


def heads_recipe(teacher, labels: dict, vocab):
  """What --kind trains on the teacher's features: (layer config, initial params, objective, the
  teacher's arrays it reads frozen, data per split in the objective's order)."""
  import jax
  from hitree_jax.heads import eagle, medusa
  from hitree_jax.heads import saved
  from hitree_jax.train import dflash, distill, eagle3, heads
  key, target = jax.random.key(FLAGS.seed), teacher.config
  frozen = saved.frozen_arrays(teacher.params, vocab)
  if FLAGS.kind == "dflash":   # the whole vocabulary, through the target's head; blocks at anchors
    config, width = dflash.layer_config(target, FLAGS.draft_layers), len(taps()) * target.hidden_size
    data = {split: (l["tokens"], l["features"][..., :width],
                    dflash.anchors(len(l["tokens"]), FLAGS.window, FLAGS.block_size, FLAGS.anchors,
                                   FLAGS.seed + (split == "eval")),
                    *dflash.full_targets(l["ids"], l["log_probs"])) for split, l in labels.items()}
    return (config, dflash.init_params(config, len(taps()), key),
            dflash.objective(config, dflash_spec(), FLAGS.loss_gamma), frozen, data)
  data = {split: (l["tokens"], l["features"], *distill.sparse_targets(l["ids"], l["log_probs"], vocab))
          for split, l in labels.items()}
  if FLAGS.kind == "eagle3":   # its own lm_head trains
    config = eagle3.layer_config(target)
    return (config, eagle3.init_params(target, teacher.params, vocab, key, len(taps())),
            eagle3.objective(eagle3_net(), config, FLAGS.ttt_steps), {"embedding": frozen["embedding"]}, data)
  config = eagle.layer_config(target, vocab.size)
  if FLAGS.kind == "eagle":
    return (config, eagle.init_params(config, key, len(taps())),
            heads.eagle_objective(config, True, FLAGS.feature_weight, FLAGS.unroll), frozen, data)
  return (config, medusa.init_params(FLAGS.num_heads, config.hidden_size),
          heads.medusa_objective(FLAGS.num_heads, True), frozen, data)


def write_heads(folder: pathlib.Path, params, teacher, vocab, made: dict) -> None:
  """The trained draft: EAGLE-3 and DFlash in vLLM's speculators format with heads.json (how it
  was made) beside it; our EAGLE and Medusa as an orbax checkpoint and heads.json."""
  from hitree_jax.heads import saved
  from hitree_jax.train import speculators
  if FLAGS.kind in ("eagle3", "dflash"):
    verifier = FLAGS.verifier or (str(teacher.path) if pathlib.Path(teacher.path).is_dir() else None)
    if verifier is None:
      logging.warning("the export names no verifier (--teacher=%s is not an HF folder): give --verifier, "
                      "e.g. the target's HF id, for the readers that load the target's embedding by it",
                      FLAGS.teacher)
    if FLAGS.kind == "eagle3":
      speculators.write_eagle3(folder, params, teacher.config, vocab, [t + 1 for t in taps()], verifier,
                               FLAGS.ttt_steps)
    else:
      speculators.write_dflash(folder, params, teacher.config, dflash_spec(), verifier)
    (folder / saved.META).write_text(json.dumps({**saved.read_meta(folder, FLAGS.kind), **made}, indent=1))
  else:
    saved.save(folder, FLAGS.kind, params, teacher.config, vocab, {**made, **({"taps": list(taps())} if taps() else {})})


def train_heads_main():
  """--kind=eagle|eagle3|dflash|medusa: labels with features, training, the folder, its evaluation."""
  from hitree_jax.loading import load_model
  from hitree_jax.tokenizer import load_tokenizer
  from hitree_jax.heads import saved
  from hitree_jax.train import distill, export

  workdir = pathlib.Path(FLAGS.workdir)
  teacher = load_model(FLAGS.teacher)
  tokenizer = load_tokenizer(teacher.path)
  labels = {split: split_labels(teacher, tokenizer, split, features=True, taps=taps()) for split in ("train", "eval")}
  vocab = None if FLAGS.kind == "dflash" else draft_vocabulary(tokenizer, teacher.config, labels["train"]["tokens"])
  config, params, objective, frozen, data = heads_recipe(teacher, labels, vocab)
  start = time.perf_counter()
  # Labels are shared by the kinds (one workdir); each kind's checkpoints are its own.
  run = FLAGS.kind + distill.taps_suffix(taps())
  run += "" if FLAGS.text == "books" else f"_{FLAGS.text}"
  params, history = distill.train(workdir / run, config, params,
                                  data["train"], data["eval"], steps=FLAGS.steps, batch=FLAGS.batch,
                                  lr=FLAGS.lr, warmup=FLAGS.warmup, seed=FLAGS.seed, until=FLAGS.until,
                                  progress=Progress("training", min_interval_s=30).update,
                                  objective=objective, frozen=frozen, settings=run_settings())
  record = {"train_s_this_run": time.perf_counter() - start, "history": history,
            "vocab_size": vocab.size if vocab else teacher.config.vocab_size}
  if FLAGS.until is not None and FLAGS.until < FLAGS.steps:
    return record
  out = out_path()
  final = history[-1] if history else {}
  with export.replacing(out) as partial:   # the old folder stays whole until this one is
    write_heads(partial, params, teacher, vocab, {
        "command": command(), "steps": FLAGS.steps,
        **{k: final[k] for k in ("eval_loss", "eval_agreement") if k in final}})
    logging.info("%s draft written; evaluating it", FLAGS.kind)
    record.update(out=str(out))
    record.update(evaluate_heads(teacher, tokenizer, f"{FLAGS.kind}:{partial}", held_out(labels)),
                  draft=f"{FLAGS.kind}:{out}")
    meta = saved.read_meta(partial)
    meta["evaluation"] = {k: v for k, v in record.items() if k not in ("history", "train_s_this_run")}
    (partial / saved.META).write_text(json.dumps(meta, indent=1))
  logging.info("%s draft written to %s", FLAGS.kind, out)
  return record


def train_main():
  from hitree_jax.loading import load_model
  from hitree_jax.loading.gguf import save_gguf
  from hitree_jax.tokenizer import gguf_tokenizer_source, load_tokenizer
  from hitree_jax.train import distill, export

  workdir = pathlib.Path(FLAGS.workdir)
  layers = tuple(int(x) for x in FLAGS.layers)
  teacher = load_model(FLAGS.teacher)
  tokenizer = load_tokenizer(teacher.path)
  labels = {split: split_labels(teacher, tokenizer, split) for split in ("train", "eval")}
  vocab = draft_vocabulary(tokenizer, teacher.config, labels["train"]["tokens"])
  data = {split: (vocab.to_draft(l["tokens"]), *distill.sparse_targets(l["ids"], l["log_probs"], vocab))
          for split, l in labels.items()}
  logging.info("draft vocabulary %d: covers %.3f of training tokens, %.3f of teacher top-1",
               vocab.size, vocab.coverage(labels["train"]["tokens"]),
               vocab.coverage(labels["train"]["ids"][..., 0]))
  config, params = distill.student_from_teacher(teacher.params, teacher.config, layers, vocab)
  start = time.perf_counter()
  params, history = distill.train(workdir, config, params, data["train"], data["eval"],
                                  steps=FLAGS.steps, batch=FLAGS.batch, lr=FLAGS.lr,
                                  warmup=FLAGS.warmup, seed=FLAGS.seed, until=FLAGS.until,
                                  progress=Progress("training", min_interval_s=30).update,
                                  settings=run_settings())
  record = {"train_s_this_run": time.perf_counter() - start, "history": history,
            "layers": layers, "vocab_size": vocab.size}
  if FLAGS.until is not None and FLAGS.until < FLAGS.steps:
    return record
  out = out_path()
  with export.replacing(out) as partial:   # the old draft and sidecar stay whole until these are
    save_gguf(partial, config, jax_to_numpy(params), vocab=vocab,
              tokenizer_from=gguf_tokenizer_source(teacher.path), quantize=FLAGS.quantize)
    record.update(out=str(out), out_mb=partial.stat().st_size / 2**20)
    logging.info("draft written (%.1f MB); evaluating it", record["out_mb"])
    record.update(evaluate(teacher, tokenizer, load_model(str(partial)), str(out), held_out(labels)))
    record["command"] = command()
    export.write_sidecar(partial, {k: v for k, v in record.items() if k not in ("history", "train_s_this_run")})
  logging.info("draft written to %s, its evaluation to %s", out, export.sidecar(out))
  return record


_DFLASH_FLAGS = ("block_size", "draft_layers", "anchors", "mask_token_id", "loss_gamma")
_TRAIN_FLAGS = ("kind", "teacher", "workdir", "out", "layers", "vocab_size", "window", "train_windows",
                "eval_windows", "topk", "steps", "batch", "lr", "warmup", "seed", "quantize",
                "feature_weight", "unroll", "taps", "num_heads", "text", "own_prompt_tokens", "ttt_steps",
                *_DFLASH_FLAGS)


def run_settings() -> dict:
  """The flags that define a training run (all of _TRAIN_FLAGS but where it is kept and written),
  and what the teacher holds."""
  own = {"ttt_steps": "eagle3", **{name: "dflash" for name in _DFLASH_FLAGS}}   # a kind's own flags
  kept = lambda name: name not in ("workdir", "out") and own.get(name, FLAGS.kind) == FLAGS.kind
  return {**{name: FLAGS[name].value for name in _TRAIN_FLAGS if kept(name)},
          "teacher_contents": teacher_contents()}


def jax_to_numpy(tree):
  import jax
  return jax.tree.map(np.asarray, tree)


def evaluate(teacher, tokenizer, draft, name: str, windows: np.ndarray | None = None) -> dict:
  """Held-out agreement / acceptance / acceptance profile, and the measured per-token cost ratio;
  on `windows` [N, T] if given (a chat draft's held-out instructions and answers), else on
  held-out book windows."""
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.train import corpus, metrics

  sampling = SamplingParams.create(FLAGS.temperature, FLAGS.top_p)
  if windows is None:
    windows = corpus.token_windows(tokenizer, "eval", FLAGS.window, FLAGS.eval_windows)
  record = metrics.evaluate_draft(teacher, draft, draft.vocab, windows, sampling)

  # Cost: seconds per decoded token of `ar` on the same held-out prompt, draft vs target.
  prompt = cost_prompt(tokenizer)
  draft_prompt = prompt if draft.vocab is None else draft.vocab.to_draft(prompt)
  return finish_record(record, name, ar_ms_per_token(teacher, prompt),
                       ar_ms_per_token(draft, draft_prompt))


def cost_prompt(tokenizer) -> np.ndarray:
  """The held-out prompt of --cost_context tokens that a draft's cost is timed after."""
  from hitree_jax.train import corpus
  return corpus.token_windows(tokenizer, "eval", FLAGS.cost_context, 1)[0]


def ar_ms_per_token(model, prompt: np.ndarray) -> float:
  """Milliseconds per decoded token of `ar` after the prompt: the median of 3 runs of 64 tokens."""
  from hitree_jax.decode import engine
  runs = [engine.generate(model.params, model.config, [prompt.tolist()], max_new_tokens=65,
                          stop_at_eos=False) for _ in range(3)]
  return 1e3 * float(np.median([r.decode_s / 64 for r in runs]))


def finish_record(record: dict, name: str, target_ms: float, draft_ms: float) -> dict:
  """An evaluation's record with its cost and settings, printed a line per field."""
  record.update(target_ms_per_token=target_ms, draft_ms_per_token=draft_ms,
                cost_ratio=draft_ms / target_ms, cost_context=FLAGS.cost_context, draft=name,
                temperature=FLAGS.temperature, top_p=FLAGS.top_p, eval_windows=FLAGS.eval_windows,
                window=FLAGS.window)
  for key, value in record.items():
    print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
  return record


def evaluate_heads(teacher, tokenizer, spec: str, windows: np.ndarray | None = None) -> dict:
  """evaluate()'s figures for a draft on the target's features (eagle:PATH: reading true
  features and its own predictions; medusa:PATH: per head), and its cost: one timed proposal
  of a one-token chain (after `sd`'s prefill) against `ar`'s decode step on the same prompt."""
  from hitree_jax import stacks
  from hitree_jax.decode import engine
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.decode.spec import Chain, Levels, parse_level
  from hitree_jax.heads import saved
  from hitree_jax.train import corpus, metrics

  level = parse_level(spec)
  heads = level.source   # a spec.FeatureDraft
  _, params, vocab = saved.load(heads.path, teacher.params, teacher.config, heads.kind)
  stack = stacks.build(Levels(level, Chain(1)), teacher.config)   # a one-token chain: its cost
  drafter = stack.drafter
  sampling = SamplingParams.create(FLAGS.temperature, FLAGS.top_p)
  if windows is None:
    windows = corpus.token_windows(tokenizer, "eval", FLAGS.window, FLAGS.eval_windows)
  if heads.kind == "dflash":
    record = metrics.evaluate_block(teacher, params, drafter.config, drafter.spec, windows, sampling)
  elif heads.kind == "eagle3":
    record = metrics.evaluate_chain(teacher, params, drafter.net, drafter.config, vocab, windows, sampling,
                                    drafter.taps)
  elif heads.kind == "eagle":
    record = metrics.evaluate_eagle(teacher, params, drafter.config, vocab, windows, sampling,
                                    taps=drafter.taps)
  else:
    record = metrics.evaluate_medusa(teacher, params, vocab, windows, sampling)
  prompt = cost_prompt(tokenizer)
  sd = engine.generate(teacher.params, teacher.config, [prompt.tolist()], max_new_tokens=65,
                       stop_at_eos=False, stack=stack,
                       draft=DraftWeights.create(params, vocab), time_levels=True)
  return finish_record(record, spec, ar_ms_per_token(teacher, prompt), sd.levels[0]["proposer_round_ms"])


def eval_main():
  from hitree_jax.decode import spec
  from hitree_jax.loading import LoadedModel, load_model
  from hitree_jax.tokenizer import load_tokenizer

  teacher = load_model(FLAGS.teacher)
  tokenizer = load_tokenizer(teacher.path)
  windows = None
  if FLAGS.text == "chat":   # judged on the held-out chat windows (labelled once in --workdir)
    windows = split_labels(teacher, tokenizer, "eval")["tokens"]
  source = spec.parse_level(FLAGS.draft).source   # check_draft has checked it
  if isinstance(source, spec.FeatureDraft):
    return evaluate_heads(teacher, tokenizer, FLAGS.draft, windows)
  if isinstance(source, spec.SelfDraft):
    k = source.layers
    params = {n: v for n, v in teacher.params.items()
              if not n.startswith("layers_") or int(n.split("_")[1]) < k}
    draft = LoadedModel(teacher.config.replace(num_layers=k), params, teacher.path)
  else:
    draft = load_model(FLAGS.draft)
  return evaluate(teacher, tokenizer, draft, FLAGS.draft, windows)


def check_flags() -> None:
  """Fails fast on a bad flag: before the teacher loads, hours of labelling and training, and
  the evaluation at the end that reads --temperature and --top_p."""
  from hitree_jax.decode.sampling import SamplingParams
  try:
    SamplingParams.create(FLAGS.temperature, FLAGS.top_p)
  except ValueError as e:
    raise app.UsageError(f"--{e}") from None
  least = {"window": 1, "eval_windows": 1, "topk": 1, "cost_context": 1}
  if not FLAGS.eval:
    least.update(train_windows=1, steps=1, batch=1, vocab_size=2, warmup=0, until=0)
  for name, bound in least.items():
    value = getattr(FLAGS, name)
    if value is not None and value < bound:
      raise app.UsageError(f"--{name}={value} must be >= {bound}")
  if FLAGS.eval:
    check_draft()
    return
  if not FLAGS.lr > 0:
    raise app.UsageError(f"--lr={FLAGS.lr} must be > 0")
  if FLAGS.batch > FLAGS.train_windows:
    raise app.UsageError(f"--batch={FLAGS.batch} must be <= --train_windows={FLAGS.train_windows}")
  if FLAGS.kind == "draft" and out_path().suffix != ".gguf":
    raise app.UsageError(f"--out={FLAGS.out} must end in .gguf (the draft is exported as GGUF)")
  if FLAGS.kind != "draft" and out_path().suffix:
    raise app.UsageError(f"--out={FLAGS.out}: {FLAGS.kind} heads are saved as a folder (no file suffix)")
  if FLAGS.num_heads < 1:
    raise app.UsageError(f"--num_heads={FLAGS.num_heads} must be >= 1")
  if FLAGS.text != "books" and not 1 <= FLAGS.own_prompt_tokens < FLAGS.window:
    raise app.UsageError(f"--own_prompt_tokens={FLAGS.own_prompt_tokens} must be in [1, --window="
                         f"{FLAGS.window})")
  n = teacher_num_layers()
  if FLAGS.kind == "draft":   # EAGLE and Medusa start from no teacher layers
    check_layers("layers", FLAGS.layers, n, allow_empty=False)
  if FLAGS.taps and FLAGS.kind not in ("eagle", "eagle3", "dflash"):
    raise app.UsageError(f"--taps={','.join(FLAGS.taps)} is for --kind=eagle, eagle3 or dflash (got "
                         f"--kind={FLAGS.kind})")
  if FLAGS.kind == "dflash":
    check_dflash_flags()
  if FLAGS.ttt_steps < 1:
    raise app.UsageError(f"--ttt_steps={FLAGS.ttt_steps} must be >= 1")
  if FLAGS.kind in ("eagle3", "dflash") and not FLAGS.taps:
    try:
      taps()
    except ValueError as e:
      raise app.UsageError(f"--kind={FLAGS.kind} --teacher={FLAGS.teacher}: {e} with --taps") from None
  check_layers("taps", FLAGS.taps, n - 1, allow_empty=True)


def check_dflash_flags() -> None:
  """--kind=dflash's block, layers, anchors, mask token and loss weights."""
  if FLAGS.block_size < 2:
    raise app.UsageError(f"--block_size={FLAGS.block_size} must be >= 2 (the root and one guess)")
  if FLAGS.draft_layers < 1:
    raise app.UsageError(f"--draft_layers={FLAGS.draft_layers} must be >= 1")
  blocks = FLAGS.window - FLAGS.block_size + 1
  if not 1 <= FLAGS.anchors <= blocks:
    raise app.UsageError(f"--anchors={FLAGS.anchors}: a window of {FLAGS.window} tokens holds 1 .. {blocks} "
                         f"blocks of {FLAGS.block_size}")
  vocab = teacher_config().vocab_size
  if FLAGS.mask_token_id is not None and not 0 <= FLAGS.mask_token_id < vocab:
    raise app.UsageError(f"--mask_token_id={FLAGS.mask_token_id}: expected a teacher id in 0..{vocab - 1}")
  if not FLAGS.loss_gamma > 0:
    raise app.UsageError(f"--loss_gamma={FLAGS.loss_gamma} must be > 0")


def check_layers(name: str, values, n: int, allow_empty: bool) -> None:
  """--layers / --taps: distinct teacher layers in 0..n-1, in increasing order for taps."""
  text = ",".join(values)
  try:
    layers = [int(x) for x in values]
  except ValueError:
    raise app.UsageError(f"--{name}={text}: expected comma-separated integers") from None
  if (not layers and not allow_empty) or not all(0 <= x < n for x in layers):
    raise app.UsageError(f"--{name}={text}: expected teacher layers in 0..{n - 1}")
  if name == "taps" and layers != sorted(set(layers)):
    raise app.UsageError(f"--taps={text}: expected distinct layers in increasing order")


def teacher_config():
  """From the teacher's config alone (no weight is read; a GGUF header parsed here is cached
  for the load that follows)."""
  from hitree_jax.loading import load_config
  try:
    return load_config(FLAGS.teacher)
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(f"--teacher={FLAGS.teacher}: {e}") from None


def teacher_num_layers() -> int:
  return teacher_config().num_layers


def eagle3_net():
  """--kind=eagle3's draft: it fuses the --taps layers (heads/eagle3.py's Eagle3Net)."""
  from hitree_jax.heads import eagle3
  return eagle3.Eagle3Net(aux=len(taps()), eps=teacher_config().rms_norm_eps)


def check_draft() -> None:
  """--eval's draft: a self-draft within the teacher, or a model file that exists."""
  from hitree_jax.decode import spec
  from hitree_jax.loading import resolve
  if not FLAGS.draft:
    raise app.UsageError("--eval needs --draft=PATH (or self:K, eagle:PATH, eagle3:PATH, dflash:PATH, "
                         "medusa:PATH)")
  try:
    source = spec.parse_level(FLAGS.draft).source
  except ValueError as e:
    raise app.UsageError(f"--draft: {e}") from None
  if isinstance(source, spec.FeatureDraft) and source.kind in ("eagle", "eagle3", "dflash", "medusa"):
    from hitree_jax.heads import saved
    try:
      saved.read_meta(source.path, source.kind)
    except (FileNotFoundError, ValueError) as e:
      raise app.UsageError(f"--draft={FLAGS.draft}: {e}") from None
    return
  if not isinstance(source, (spec.SelfDraft, spec.DraftModel)):
    raise app.UsageError(f"--draft={FLAGS.draft}: --eval measures a draft model (PATH or self:K) or "
                         "heads on its features (eagle:PATH, eagle3:PATH, dflash:PATH, medusa:PATH); "
                         "this one has no distribution of its own to compare")
  if isinstance(source, spec.SelfDraft):
    n = teacher_num_layers()
    if not 1 <= source.layers < n:
      raise app.UsageError(f"--draft={FLAGS.draft}: K must be in [1, {n}) for this teacher")
    return
  try:
    resolve(FLAGS.draft)
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(f"--draft={FLAGS.draft}: {e}") from None


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  check_flags()
  if not FLAGS.eval:   # a workdir of another run (another teacher, other flags) before anything loads
    from hitree_jax.train import distill
    distill.check_settings(pathlib.Path(FLAGS.workdir), run_settings(), record=False)
  record = eval_main() if FLAGS.eval else train_main() if FLAGS.kind == "draft" else train_heads_main()
  if FLAGS.json:
    print(json.dumps(record))


def run():
  common.run(main)


if __name__ == "__main__":
  run()
