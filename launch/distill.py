"""Distil a small draft from a target, export it as a GGUF, and evaluate drafts.

Train (labels, training and export; an interrupted run resumes from workdir):
  python -m launch.distill --teacher=smollm2 --workdir=runs/draft \
      --out=drafts/smollm2-draft.gguf
Train EAGLE's one-layer feature draft on the target's features (heads/eagle.py):
  python -m launch.distill --kind=eagle --workdir=runs/eagle --out=drafts/smollm2-eagle
Evaluate a draft on held-out books (agreement, acceptance, cost ratio):
  python -m launch.distill --eval --draft=drafts/smollm2-draft.gguf --json

Data: token windows cut evenly from every training book of the three corpora
(held-out books in hitree_jax/train/corpus.py), labelled once with the
teacher's top-k next-token log-probabilities (cached in workdir). Every flag is
checked before the teacher loads; labelling and training log progress with an ETA.
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
from absl import app, flags, logging

from launch import common
from launch.progress import Progress

common.define_config_flag()

flags.DEFINE_enum("kind", "draft", ["draft", "eagle"], "What to train: a small draft model made "
                  "of teacher layers (GGUF), or EAGLE's feature draft on the teacher (a folder).")
flags.DEFINE_string("teacher", "smollm2", "The target model to imitate (any --model spec).")
flags.DEFINE_string("workdir", "runs/draft", "Labels, orbax checkpoints and logs (resumable).")
flags.DEFINE_string("out", "drafts/smollm2-draft.gguf", "Where the trained draft is written: a GGUF "
                    "(--kind=draft) or a folder (--kind=eagle; by default drafts/smollm2-eagle).")
flags.DEFINE_list("layers", ["0", "1", "29"], "Teacher layers the student starts from, in order.")
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
flags.DEFINE_bool("eval", False, "Evaluate --draft against --teacher instead of training.")
flags.DEFINE_string("draft", None, "--eval: the draft, as --draft of launch.generate: PATH (a GGUF "
                    "from this launcher), eagle:PATH (a --kind=eagle folder) or self:K (the "
                    "teacher's first K layers).")
flags.DEFINE_float("temperature", 0.6, "--eval: sampling temperature of the acceptance metric.")
flags.DEFINE_float("top_p", 0.9, "--eval: nucleus mass of the acceptance metric.")
flags.DEFINE_integer("cost_context", 512, "--eval: prompt tokens when timing a decode step.")
flags.DEFINE_bool("json", False, "Print one JSON record as the last line.")
FLAGS = flags.FLAGS


def out_path() -> pathlib.Path:
  """--out, or for --kind=eagle left at the GGUF default, drafts/smollm2-eagle."""
  if FLAGS.kind == "eagle" and FLAGS.out == FLAGS["out"].default:
    return pathlib.Path("drafts/smollm2-eagle")
  return pathlib.Path(FLAGS.out)


def command() -> str:
  """The launch.distill command line that reproduces this training run."""
  return "python -m launch.distill " + " ".join(
      f"--{name}={flag.value if not isinstance(flag.value, list) else ','.join(flag.value)}"
      for name, flag in sorted(FLAGS.__flags.items())
      if flag.present and name in _TRAIN_FLAGS)


def train_eagle_main():
  import jax
  from hitree_jax.heads import eagle
  from hitree_jax.loading import load_model
  from hitree_jax.model.vocab import ReducedVocab
  from hitree_jax.tokenizer import load_tokenizer
  from hitree_jax.train import corpus, distill
  from hitree_jax.train import eagle as eagle_train

  workdir = pathlib.Path(FLAGS.workdir)
  teacher = load_model(FLAGS.teacher)
  tokenizer = load_tokenizer(teacher.path)
  vocab = ReducedVocab.most_frequent(corpus.token_counts(tokenizer, teacher.config.vocab_size),
                                     FLAGS.vocab_size)
  labels = {split: distill.prepare_labels(workdir, split, teacher, tokenizer, window=FLAGS.window,
                                          n_windows=n, k=FLAGS.topk, features=True,
                                          progress=Progress(f"labelling {split} windows").update)
            for split, n in (("train", FLAGS.train_windows), ("eval", FLAGS.eval_windows))}
  data = {split: (l["tokens"], l["features"], *distill.sparse_targets(l["ids"], l["log_probs"], vocab))
          for split, l in labels.items()}
  config = eagle.layer_config(teacher.config, vocab.size)
  objective = eagle_train.objective(config, True, FLAGS.feature_weight, FLAGS.unroll)
  start = time.perf_counter()
  params, history = distill.train(workdir, config, eagle.init_params(config, jax.random.key(FLAGS.seed)),
                                  data["train"], data["eval"], steps=FLAGS.steps, batch=FLAGS.batch,
                                  lr=FLAGS.lr, warmup=FLAGS.warmup, seed=FLAGS.seed, until=FLAGS.until,
                                  progress=Progress("training", min_interval_s=30).update,
                                  objective=objective, frozen=eagle_train.frozen_arrays(teacher.params, vocab))
  record = {"train_s_this_run": time.perf_counter() - start, "history": history, "vocab_size": vocab.size}
  if FLAGS.until is not None and FLAGS.until < FLAGS.steps:
    return record
  out = out_path()
  final = history[-1] if history else {}
  eagle_train.save(out, params, teacher.config, vocab,
                   {"command": command(), "steps": FLAGS.steps,
                    **{k: final[k] for k in ("eval_loss", "eval_agreement") if k in final}})
  logging.info("EAGLE draft written to %s", out)
  record.update(out=str(out))
  return record


def train_main():
  from hitree_jax.loading import load_model
  from hitree_jax.loading.gguf import save_gguf
  from hitree_jax.model.vocab import ReducedVocab
  from hitree_jax.tokenizer import load_tokenizer
  from hitree_jax.train import corpus, distill

  workdir = pathlib.Path(FLAGS.workdir)
  layers = tuple(int(x) for x in FLAGS.layers)
  teacher = load_model(FLAGS.teacher)
  tokenizer = load_tokenizer(teacher.path)
  vocab = ReducedVocab.most_frequent(corpus.token_counts(tokenizer, teacher.config.vocab_size),
                                     FLAGS.vocab_size)
  labels = {split: distill.prepare_labels(workdir, split, teacher, tokenizer, window=FLAGS.window,
                                          n_windows=n, k=FLAGS.topk,
                                          progress=Progress(f"labelling {split} windows").update)
            for split, n in (("train", FLAGS.train_windows), ("eval", FLAGS.eval_windows))}
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
                                  progress=Progress("training", min_interval_s=30).update)
  record = {"train_s_this_run": time.perf_counter() - start, "history": history,
            "layers": layers, "vocab_size": vocab.size}
  if FLAGS.until is not None and FLAGS.until < FLAGS.steps:
    return record
  out = out_path()
  out.parent.mkdir(parents=True, exist_ok=True)
  save_gguf(out, config, jax_to_numpy(params), vocab=vocab,
            tokenizer_from=teacher.path if teacher.path.suffix == ".gguf" else None,
            quantize=FLAGS.quantize)
  record.update(out=str(out), out_mb=out.stat().st_size / 2**20)
  logging.info("draft written to %s (%.1f MB); evaluating it", out, record["out_mb"])
  record.update(evaluate(teacher, tokenizer, load_model(str(out)), str(out)))
  record["command"] = command()
  sidecar = out.with_suffix(".json")
  sidecar.write_text(json.dumps({k: v for k, v in record.items()
                                 if k not in ("history", "train_s_this_run")}, indent=1))
  logging.info("evaluation written to %s", sidecar)
  return record


_TRAIN_FLAGS = ("kind", "teacher", "workdir", "out", "layers", "vocab_size", "window", "train_windows",
                "eval_windows", "topk", "steps", "batch", "lr", "warmup", "seed", "quantize",
                "feature_weight", "unroll")


def jax_to_numpy(tree):
  import jax
  return jax.tree.map(np.asarray, tree)


def evaluate(teacher, tokenizer, draft, name: str) -> dict:
  """Held-out agreement / acceptance / acceptance profile, and the measured per-token cost ratio."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.train import corpus, metrics

  sampling = SamplingParams.create(FLAGS.temperature, FLAGS.top_p)
  windows = corpus.token_windows(tokenizer, "eval", FLAGS.window, FLAGS.eval_windows)
  record = metrics.evaluate_draft(teacher, draft, draft.vocab, windows, sampling)

  # Cost: seconds per decoded token of `ar` on the same held-out prompt, draft vs target.
  prompt = corpus.token_windows(tokenizer, "eval", FLAGS.cost_context, 1)[0]
  per_token = {}
  for role, model in (("target", teacher), ("draft", draft)):
    ids = prompt if model.vocab is None else model.vocab.to_draft(prompt)
    runs = [engine.generate(model.params, model.config, [ids.tolist()], max_new_tokens=65,
                            stop_at_eos=False) for _ in range(3)]
    per_token[role] = float(np.median([r.decode_s / 64 for r in runs]))
  record.update(target_ms_per_token=1e3 * per_token["target"],
                draft_ms_per_token=1e3 * per_token["draft"],
                cost_ratio=per_token["draft"] / per_token["target"], cost_context=FLAGS.cost_context,
                draft=name, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                eval_windows=FLAGS.eval_windows, window=FLAGS.window)
  for key, value in record.items():
    print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
  return record


def evaluate_eagle(teacher, tokenizer, path: str) -> dict:
  """evaluate()'s figures for an EAGLE draft (depth 1 and depth 2), its cost from one timed
  round of `sd` with a one-token chain against `ar`'s decode step on the same prompt."""
  from hitree_jax.decode import engine
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.decode.stack import Stack
  from hitree_jax.heads.drafter import EagleDrafter
  from hitree_jax.train import corpus, metrics
  from hitree_jax.train import eagle as eagle_train
  from hitree_jax.tree import shapes as tree_lib

  config, params, vocab = eagle_train.load(path, teacher.params, teacher.config)
  sampling = SamplingParams.create(FLAGS.temperature, FLAGS.top_p)
  windows = corpus.token_windows(tokenizer, "eval", FLAGS.window, FLAGS.eval_windows)
  record = metrics.evaluate_eagle(teacher, params, config, vocab, windows, sampling)
  prompt = corpus.token_windows(tokenizer, "eval", FLAGS.cost_context, 1)[0].tolist()
  ar = [engine.generate(teacher.params, teacher.config, [prompt], max_new_tokens=65, stop_at_eos=False)
        for _ in range(3)]
  drafter = EagleDrafter(config, target_vocab_size=vocab and vocab.target_vocab_size)
  sd = engine.generate(teacher.params, teacher.config, [prompt], max_new_tokens=65, stop_at_eos=False,
                       stack=Stack(drafter, tree_lib.chain(1)), draft=DraftWeights.create(params, vocab),
                       time_levels=True)
  target_ms = 1e3 * float(np.median([r.decode_s / 64 for r in ar]))
  draft_ms = sd.levels[0]["proposer_round_ms"]
  record.update(target_ms_per_token=target_ms, draft_ms_per_token=draft_ms, cost_ratio=draft_ms / target_ms,
                cost_context=FLAGS.cost_context, draft=f"eagle:{path}", temperature=FLAGS.temperature,
                top_p=FLAGS.top_p, eval_windows=FLAGS.eval_windows, window=FLAGS.window)
  for key, value in record.items():
    print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
  return record


def eval_main():
  from hitree_jax.decode.drafters import SelfDrafter, parse_draft_spec
  from hitree_jax.loading import LoadedModel, load_model
  from hitree_jax.tokenizer import load_tokenizer

  teacher = load_model(FLAGS.teacher)
  tokenizer = load_tokenizer(teacher.path)
  if FLAGS.draft.startswith("eagle:"):
    return evaluate_eagle(teacher, tokenizer, FLAGS.draft.removeprefix("eagle:"))
  if FLAGS.draft.startswith("self:"):
    drafter = parse_draft_spec(FLAGS.draft)
    assert isinstance(drafter, SelfDrafter)
    k = drafter.num_layers
    params = {n: v for n, v in teacher.params.items()
              if not n.startswith("layers_") or int(n.split("_")[1]) < k}
    draft = LoadedModel(teacher.config.replace(num_layers=k), params, teacher.path)
  else:
    draft = load_model(FLAGS.draft)
  return evaluate(teacher, tokenizer, draft, FLAGS.draft)


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
  if FLAGS.kind == "eagle" and out_path().suffix:
    raise app.UsageError(f"--out={FLAGS.out}: an EAGLE draft is a folder (no file suffix)")
  try:
    layers = [int(x) for x in FLAGS.layers]
  except ValueError:
    raise app.UsageError(f"--layers={','.join(FLAGS.layers)}: expected comma-separated "
                         "integers") from None
  n = teacher_num_layers()
  if not layers or not all(0 <= x < n for x in layers):
    raise app.UsageError(f"--layers={','.join(FLAGS.layers)}: the teacher has layers 0..{n - 1}")


def teacher_num_layers() -> int:
  """From the teacher's config alone (no weight is read; a GGUF header parsed here is cached
  for the load that follows)."""
  from hitree_jax.loading import load_config
  try:
    return load_config(FLAGS.teacher).num_layers
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(f"--teacher={FLAGS.teacher}: {e}") from None


def check_draft() -> None:
  """--eval's draft: a self-draft within the teacher, or a model file that exists."""
  from hitree_jax.decode.drafters import SelfDrafter, parse_draft_spec
  from hitree_jax.loading import resolve
  if not FLAGS.draft:
    raise app.UsageError("--eval needs --draft=PATH (or self:K, or eagle:PATH)")
  if FLAGS.draft.startswith("eagle:"):
    from hitree_jax.train import eagle as eagle_train
    try:
      eagle_train.read_meta(FLAGS.draft.removeprefix("eagle:"))
    except FileNotFoundError as e:
      raise app.UsageError(f"--draft={FLAGS.draft}: {e}") from None
    return
  if FLAGS.draft.startswith(("self:", "ngram")):
    try:
      drafter = parse_draft_spec(FLAGS.draft)
    except ValueError as e:
      raise app.UsageError(f"--draft: {e}") from None
    if not isinstance(drafter, SelfDrafter):
      raise app.UsageError(f"--draft={FLAGS.draft}: --eval measures a draft model (PATH or "
                           "self:K); n-gram lookup has no distribution to compare")
    n = teacher_num_layers()
    if not 1 <= drafter.num_layers < n:
      raise app.UsageError(f"--draft={FLAGS.draft}: K must be in [1, {n}) for this teacher")
    return
  try:
    resolve(FLAGS.draft)
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(f"--draft={FLAGS.draft}: {e}") from None


def _quiet_orbax(record) -> bool:
  return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_quiet_orbax)  # it logs every save step at INFO
  check_flags()
  record = eval_main() if FLAGS.eval else train_eagle_main() if FLAGS.kind == "eagle" else train_main()
  if FLAGS.json:
    print(json.dumps(record))


def run():
  common.run(main)


if __name__ == "__main__":
  run()
