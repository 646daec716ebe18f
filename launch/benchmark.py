"""Decode speed on deterministic book prompts, written as JSON, a markdown table and PNG plots.

  python -m launch.benchmark --model=smollm2 --methods=ar --prompt_tokens=512,2048,6000 \
      --max_new_tokens=128 --n_prompts=3 --out=results.json
  python -m launch.benchmark --methods=ar,sd/ngram/4,tree/self:8/kary:2x2 --prompt_tokens=512 \
      --temperature=0.6 --top_p=0.9

Each (method, prompt length) is compiled and warmed up on its first prompt
before anything is timed; EOS is ignored so every run decodes exactly
--max_new_tokens tokens. Speeds are decode tokens/s (prefill excluded).
--out=results.json also writes results.md (the table, and one per level of each
speculative method), results_speed.png (tok/s and speedup vs ar per prompt
length), results_acceptance.png (draft tokens accepted per round at each tree
depth), results_levels.png (acceptance and share of time per level) and
results_gammas.png (hierarchies: speedup by the bottom tree's depth and the
middle level's gamma).

--peers=hf,llamacpp adds rows for HF transformers and llama.cpp decoding the same
prompt ids the same way (launch/peers.py; greedy rows say how many leading
tokens equal our `ar`'s). They are timed in turn with `ar`, prompt by prompt
(`ar` on prompt i, then each peer on it), so drift over a run falls on both
alike; each run's `order` in the JSON says when it was timed:

  python -m launch.convert --out=smollm2_f32.gguf
  python -m launch.benchmark --methods=ar --peers=hf,llamacpp --llamacpp_gguf=smollm2_f32.gguf

--text names the text: a book's passages (austen, the default; shakespeare; milton), or chat.
--text=chat runs Spec-Bench's protocol instead of book passages: its 480 chat questions
in six tasks (data/spec_bench/), in the model's chat template, EOS honoured, 256 new tokens at
most, MT-bench's second turn after the model's own first answer. It reports the speedup over
`ar` per task, τ (tokens per target forward) and tok/s, as OUT.json, OUT.md and
OUT_specbench.png. Under greedy decoding it checks that every method's tokens equal `ar`'s on
every turn, and names any question that differs, with the target's top-2 logit margin where it
parts (a near-tie, where rounding may pick either token, or a fault). --questions=PATH.jsonl
reads your own questions in the same format instead:

  python -m launch.benchmark --text=chat --per_category=10 \
      --methods=ar,sd/ngram/4,sd/drafts/smollm2-draft.gguf/3 --out=specbench.json

--batch_sizes=1,4,16 decodes that many prompts at a time, a row each: book passages (a run is a
batch of distinct passages, --n_prompts runs per size), or the questions (turn by turn:
MT-bench's second turns form the next batch). Tokens/s counts every row's tokens over the
batch's decode seconds, and the speedup is over `ar` at the same batch size. Greedy rows are
compared with `ar`'s: a passage's with `ar` at the same batch size, a question's with `ar` at
batch 1 (what each question gives alone), beside a row's latency (its batch's decode time).
The figures draw batch 1; the table has every size.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import pathlib
import platform
import statistics
import time

from absl import app, flags, logging

from hitree_jax import huge_pages
from hitree_jax import methods as methods_lib
from hitree_jax.data import CHAT
from hitree_jax.errors import UsageError
from . import common
from .progress import Progress
from .tables import level_markdown, markdown, prediction_markdown, stack_shape
from .tables import name as result_name

common.define_config_flag()
common.define_model_flags()
common.define_sampling_flags()
common.define_mesh_flags()
common.define_cache_sizing_flag()
common.define_speculation_flags()
flags.DEFINE_list("methods", ["ar"], "Configurations to compare: ar, sd[/DRAFT[/GAMMA]], "
                  "tree[/DRAFT[/TREE]], retrieval[/GAMMA], triforce[/DRAFT], hitree[/DRAFT[/TREE]], "
                  "hsd/LEVELS (missing parts from --draft, --gamma, --tree, --budget, ...), auto "
                  "(the planner's stack around --draft=PATH, per prompt length).")
flags.DEFINE_list("prompt_tokens", ["512", "2048"], "Prompt lengths in tokens.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt (EOS is ignored).")
flags.DEFINE_integer("n_prompts", 3, "Prompts per length.")
flags.DEFINE_integer("seeds", 1, "Sampled runs: each prompt (or batch) runs at this many seeds, --seed on, a "
                     "run each (one sample of a 128-token text is a noisy measure of a sampled method).")
common.define_text_flag("austen", "The prompts: passages of a book (austen, shakespeare, milton), "
                        "--prompt_tokens long; or chat: chat questions (Spec-Bench's, or --questions) "
                        "in the model's chat template, under Spec-Bench's protocol.")
flags.DEFINE_bool("time_levels", True, "Time one round of each level alone (a program per level "
                  "to compile) and report each level's share of the decode time.")
flags.DEFINE_list("peers", [], "Other engines to time on the same prompt ids, when installed: hf "
                  "(transformers on PyTorch), llamacpp (llama-cpp-python). See launch/peers.py.")
flags.DEFINE_list("llamacpp_cache", ["f16"], "What llama.cpp's KV cache stores, a row each: f16 "
                  "(llama.cpp's default) and/or f32 (the precision of ours).")
flags.DEFINE_list("llamacpp_gguf", [], "GGUF files llama.cpp runs, a row each (default: the model's "
                  "own file; `python -m launch.convert --out=X.gguf` writes our weights at F32).")
flags.DEFINE_bool("predict", False, "Also record the planner's prediction for each stack (from the "
                  "profile of --draft at each prompt length, measured on first use; launch/plan.py) "
                  "and plot predicted against measured (OUT_predicted.png).")
flags.DEFINE_string("questions", None, "--text=chat: a .jsonl of question_id, category, turns (Spec-Bench's "
                    "format) instead of Spec-Bench's own questions.")
flags.DEFINE_list("categories", [], "--text=chat: only these tasks (mt_bench, translation, "
                  "summarization, qa, math_reasoning, rag) or categories (e.g. coding).")
flags.DEFINE_integer("per_category", None, "--text=chat: at most this many questions per task.")
flags.DEFINE_list("batch_sizes", ["1"], "Run every method at each of these batch sizes: questions "
                  "(or passages) decoded together, a row each. Reports tokens/s over all rows, "
                  "each row's latency and tokens per target forward.")
flags.DEFINE_string("out", "results.json", "Where to write the JSON results (the table and plots "
                    "go beside it: OUT.md, OUT_speed.png, OUT_acceptance.png).")
FLAGS = flags.FLAGS


def run_one(model, method, group, sampling, programs, mesh=None, seed=None):
  """One timed generation of a group of prompts (one, or a batch), EOS ignored."""
  return method.generate(model.params, model.config, group, max_new_tokens=FLAGS.max_new_tokens,
                         sampling=sampling, seed=FLAGS.seed if seed is None else seed, stop_at_eos=False,
                         programs=programs, time_levels=FLAGS.time_levels, mesh=mesh,
                         size_caches_for=FLAGS.size_caches_for)


def check_flags() -> list[int]:
  """Fails fast, before the slow model load, on a bad count; returns --prompt_tokens as numbers."""
  if not FLAGS.methods:
    raise app.UsageError("--methods: give at least one method (e.g. ar,sd/ngram/4)")
  lengths = common.positive_ints("prompt_tokens")
  from . import peers
  peers.check(FLAGS.peers, FLAGS.llamacpp_gguf)
  if not FLAGS.llamacpp_cache or set(FLAGS.llamacpp_cache) - set(peers.LLAMACPP_CACHES):
    raise app.UsageError(f"--llamacpp_cache={','.join(FLAGS.llamacpp_cache)}: expected f16 and/or f32")
  for name, value in [("max_new_tokens", FLAGS.max_new_tokens), ("n_prompts", FLAGS.n_prompts),
                      ("seeds", FLAGS.seeds)]:
    if value < 1:
      raise app.UsageError(f"--{name}={value} must be >= 1")
  if FLAGS.seeds > 1 and FLAGS.temperature == 0:
    raise app.UsageError(f"--seeds={FLAGS.seeds}: greedy decoding gives the same tokens at every seed "
                         "(give --temperature > 0, or leave --seeds at 1)")
  if FLAGS.seeds > 1 and FLAGS.text == CHAT:
    raise app.UsageError(f"--seeds={FLAGS.seeds} runs book passages at several seeds; --text=chat runs "
                         "each question once")
  return lengths


def batch_sizes() -> list[int]:
  return common.positive_ints("batch_sizes")


def write_outputs(record: dict) -> None:
  """OUT.json, OUT.md and the plots, all named from --out (by process 0 of a multi-host run)."""
  if not common.writes_outputs():
    return
  from . import plots
  out = pathlib.Path(FLAGS.out)
  beside = lambda tail: out.with_name(out.stem + tail)  # results.json -> results_speed.png
  out.write_text(json.dumps(record, indent=2))
  table = markdown(record["results"])
  per_level = level_markdown(record["results"])
  predicted = prediction_markdown(record["results"])
  beside(".md").write_text(table + "\n" + "".join(f"\n{part}\n" for part in (per_level, predicted) if part))
  written = [out, beside(".md")]
  single = {**record, "results": [r for r in record["results"] if r.get("batch_size", 1) == 1]}
  if single["results"]:   # the figures draw one prompt at a time (batches: the table)
    plots.speed_figure(single, beside("_speed.png"))
    written.append(beside("_speed.png"))
  for tail, figure in [("_acceptance.png", plots.acceptance_figure), ("_levels.png", plots.levels_figure),
                       ("_gammas.png", plots.gamma_figure), ("_predicted.png", plots.predicted_figure)]:
    if single["results"] and figure(single, beside(tail)):
      written.append(beside(tail))
  print(table)
  for part in (per_level, predicted):
    if part:
      print(part)
  logging.info("wrote %s", ", ".join(map(str, written)))


def questions():
  """--text=chat's questions (Spec-Bench's, or --questions'), --categories and --per_category
  applied; None for book passages. Checked before any weights load."""
  if FLAGS.text != CHAT:
    for name in ("questions", "categories", "per_category"):
      if FLAGS[name].present:
        raise app.UsageError(f"--{name} applies to --text=chat, not to --text={FLAGS.text}'s passages")
    return None
  from hitree_jax import spec_bench
  for name in ("prompt_tokens", "n_prompts", "peers", "predict"):
    if FLAGS[name].present:
      raise app.UsageError(f"--{name} applies to book passages, not --text=chat")
  return spec_bench.select(spec_bench.read(FLAGS.questions), FLAGS.categories, FLAGS.per_category)


def load_target(mesh, methods):
  """The target placed on the mesh, its tokenizer, and the methods with their drafts loaded
  (`auto` stays: it is planned per prompt length)."""
  from hitree_jax import sharding
  from hitree_jax.loading import load_model
  from hitree_jax.tokenizer import load_tokenizer
  model = load_model(FLAGS.model, common.model_dtype(), FLAGS.key_dtype)
  sharding.check(model.config, mesh, 1, 256)
  model = dataclasses.replace(model, params=sharding.place_params(model.params, mesh))
  methods = [m if m == "auto" else m.load_draft(model.config, model.params) for m in methods]
  return model, load_tokenizer(model.path), methods


def run_questions(chosen, methods, sampling, mesh) -> None:
  """Spec-Bench's protocol over `chosen` (launch/spec_bench_run.py): every method on every
  question, then the report."""
  import jax
  from hitree_jax.decode.programs import Programs
  from . import spec_bench_run
  max_new = FLAGS.max_new_tokens if FLAGS["max_new_tokens"].present else 256
  model, tokenizer, methods = load_target(mesh, methods)
  sizes = batch_sizes()
  if "auto" in methods:   # one plan per batch size for the questions' typical length
    import numpy as np
    from hitree_jax.tokenizer import conversation_prompt
    typical = int(np.median([len(conversation_prompt(tokenizer, q.turns[:1], [])) for q in chosen]))
    planned = {size: planned_auto(model, typical, sampling, size, "chat") for size in sizes}
  else:
    planned = {}
  progress = Progress("spec-bench", sum(len(methods) * (len(spec_bench_run.batches(chosen, b)) + 1) for b in sizes))
  by_run = {}
  for size, method in itertools.product(sizes, methods):
    method = planned[size] if method == "auto" else method
    programs = Programs()
    jax.clear_caches()
    gc.collect()
    ask = lambda qs: spec_bench_run.answer(model, tokenizer, method, qs, sampling, programs, mesh, max_new, FLAGS.seed,
                                           FLAGS.size_caches_for)
    groups = spec_bench_run.batches(chosen, size)
    ask(groups[0])   # warm-up: compiles; not counted
    at = f" x{size}" if size != 1 else ""
    progress.step(detail=f"{method.label}{at} warm-up")
    runs = []
    for group in groups:
      for q, turns in zip(group, ask(group)):
        runs.append({"question_id": q.question_id, "task": q.task, "category": q.category, "turns": turns})
      progress.step(detail=f"{method.label}{at} questions {group[0].question_id}-{group[-1].question_id}")
    by_run[method.label, size] = runs
    # What has run so far survives a run cut short (the margins of any parting come at the end).
    if common.writes_outputs():
      write_questions_record(by_run, spec_bench_run.rows(by_run, FLAGS.temperature == 0), max_new, sizes,
                             chosen)
  greedy = FLAGS.temperature == 0
  from hitree_jax import near_ties
  margins_of = lambda prompt, answer: near_ties.top2_margins(model.params, model.config, prompt, answer)
  tie = near_ties.tie_margin(model.config)
  results = spec_bench_run.rows(by_run, greedy, margins_of, tie)
  table = spec_bench_run.markdown(results)
  if common.writes_outputs():
    out = write_questions_record(by_run, results, max_new, sizes, chosen)
    out.with_suffix(".md").write_text(table + "\n")
    written = [out, out.with_suffix(".md")]
    if spec_bench_run.figure(results, out.with_name(out.stem + "_specbench.png")):
      written.append(out.with_name(out.stem + "_specbench.png"))
    logging.info("wrote %s", ", ".join(map(str, written)))
  print(table)
  for r in results:
    for d in r.get("differs_from_ar", []):
      print(spec_bench_run.parting_line(result_name(r), d))
  fail_on_faults(results, tie, lambda d: f"question {d['question_id']} turn {d['turn']}")


def write_questions_record(by_run: dict, results: list[dict], max_new: int, sizes: list[int], chosen) -> pathlib.Path:
  """--out's JSON for --text=chat: the settings, the report's rows and every turn's figures."""
  from . import spec_bench_run
  out = pathlib.Path(FLAGS.out)
  runs = [{"method": m, "batch_size": size,
           "questions": [{**r, "turns": [{k: v for k, v in t.items() if k not in ("tokens", "prompt")}
                                         for t in r["turns"]]} for r in rs]} for (m, size), rs in by_run.items()]
  out.write_text(json.dumps({**record([]), "questions": FLAGS.questions or "specbench", "max_new_tokens": max_new, "batch_sizes": sizes,
                             "tasks": spec_bench_run.tasks_count(chosen), "results": results, "runs": runs},
                            indent=2))
  return out


def default_auto_draft(text: str) -> None:
  """Without --draft, `auto` plans around the model's shipped draft for this kind of text."""
  if not FLAGS["draft"].present:
    FLAGS.draft = methods_lib.default_auto_draft(FLAGS.model, text)


def parsed_methods(specs: list[str]) -> list:
  """--methods parsed with the speculation flags; `auto` stays a name (planned once the target
  is loaded)."""
  greedy = FLAGS.temperature == 0
  return [spec if spec == "auto" else methods_lib.parse_method(spec, common.knobs_from_flags(FLAGS), greedy)
          for spec in specs]


def main(argv):
  del argv
  mesh = common.mesh_from_flags(FLAGS)  # first: a multi-host run joins before jax starts
  chosen = questions()
  batch_sizes()   # a bad --batch_sizes fails before the model loads
  if chosen is not None:
    specs = methods_lib.join_method_specs(FLAGS.methods)
    if "auto" in specs:
      default_auto_draft(CHAT)
      methods_lib.check_auto_draft(FLAGS.draft, FLAGS.feature_draft)
    return run_questions(chosen, parsed_methods(specs), common.sampling_from_flags(FLAGS), mesh)
  lengths = check_flags()
  specs = methods_lib.join_method_specs(FLAGS.methods)
  if "auto" in specs or FLAGS.predict:
    default_auto_draft(FLAGS.text)
    methods_lib.check_auto_draft(FLAGS.draft, FLAGS.feature_draft)
  elif FLAGS.feature_draft is not None:
    raise UsageError("--feature_draft is weighed by the planner: it applies to --methods=auto and --predict")
  methods = parsed_methods(specs)
  sampling = common.sampling_from_flags(FLAGS)
  import jax
  from hitree_jax.data import book_prompts
  from hitree_jax.decode.programs import Programs

  model, tokenizer, methods = load_target(mesh, methods)
  from hitree_jax import near_ties
  margins_of = lambda prompt, answer: near_ties.top2_margins(model.params, model.config, prompt, answer)
  tie = near_ties.tie_margin(model.config)
  peer_engines = make_peers(model.path, max(lengths))
  rows = []
  ar_tokens = {}  # (prompt length, batch size, run) -> ar's tokens per row: what greedy runs are compared with
  greedy_tokens = {}  # (method, prompt length, batch size, run) -> its tokens per row, compared with ar's
  order = itertools.count()  # each timed run's place in the benchmark (the JSON's `order`)
  sizes = batch_sizes()
  plans = {}   # (prompt length, batch size) -> the methods with `auto` planned
  progress = Progress("benchmark", len(lengths) * sum(len(methods) * (FLAGS.n_prompts * FLAGS.seeds + 1)
                                                      + len(peer_engines) * (b == 1) * (FLAGS.n_prompts + 1)
                                                      for b in sizes))
  for n_tokens, size in itertools.product(lengths, sizes):
    # --n_prompts groups of `size` passages (a batch of B passages takes B x n_prompts of them)
    passages = book_prompts(tokenizer, n_tokens, FLAGS.n_prompts * size, corpus=FLAGS.text)
    groups = [passages[i * size:(i + 1) * size] for i in range(FLAGS.n_prompts)]
    at = f" x{size}" if size != 1 else ""
    if (n_tokens, size) not in plans:   # auto is planned per prompt length and batch size, once
      plans[n_tokens, size] = [planned_auto(model, n_tokens, sampling, size, FLAGS.text) if m == "auto" else m
                               for m in methods]
    planned = plans[n_tokens, size]
    for method in planned:
      # Each method's programs live only while it runs: a process holding every method's
      # (a dozen hierarchies, a program per level each) ran XLA:CPU out of code memory.
      programs = Programs()
      jax.clear_caches()
      gc.collect()
      warm = run_one(model, method, groups[0], sampling, programs, mesh)  # compiles; not timed
      progress.step(detail=f"{method.label}{at} P={n_tokens} warm-up ({warm.compile_s:.1f} s compiling)")
      # Peers are timed between `ar`'s prompts, so a machine's drift over the run (its clock,
      # a neighbour's load) falls on both engines alike rather than on whichever runs later.
      beside = peer_engines if method.label == "ar" and size == 1 else []
      for peer in beside:
        peer_warm_up(peer, n_tokens, groups[0][0], progress)
      runs, peer_runs = [], {peer: [] for peer in beside}
      for (i, group), seed in itertools.product(enumerate(groups), range(FLAGS.seed, FLAGS.seed + FLAGS.seeds)):
        r = run_one(model, method, group, sampling, programs, mesh, seed)
        runs.append({"prompt": i, **({"seed": seed} if FLAGS.seeds > 1 else {}), "order": next(order),
                     "prefill_s": r.prefill_s, "decode_s": r.decode_s,
                     "new_tokens": sum(map(len, r.tokens)), "decode_tokens_per_s": r.decode_tokens_per_s,
                     "compiles": r.compiles, "cache_loads": r.cache_loads, "target_forwards": r.target_forwards,
                     "mean_accepted": r.mean_accepted, "accepted_per_depth": r.accepted_per_depth,
                     "levels": r.levels, **({"rows": size} if size != 1 else {}),
                     **({} if r.aside_per_row is None else {"rounds_aside": sum(r.aside_per_row),
                                                            "stepped_aside": sum(r.stepped_aside_per_row)})})
        if method.label == "ar":
          ar_tokens[n_tokens, size, i] = r.tokens
        elif FLAGS.temperature == 0:
          greedy_tokens[method.label, n_tokens, size, i] = r.tokens
        progress.step(detail=f"{method.label}{at} P={n_tokens} prompt {i}"
                             f"{f' seed {seed}' if FLAGS.seeds > 1 else ''}: {r.decode_tokens_per_s:.2f} tok/s")
        for peer in beside if seed == FLAGS.seed else ():   # a peer runs each prompt once
          peer_runs[peer].append(peer_run(peer, n_tokens, i, group[0], ar_tokens, next(order), progress))
      accepted = [x["mean_accepted"] for x in runs if x["mean_accepted"] is not None]
      rows.append({
          "method": method.label, "prompt_tokens": n_tokens, **({"batch_size": size} if size != 1 else {}),
          "runs": runs, "compile_s": warm.compile_s, **stack_shape(method.stack),
          **(prediction(model, method, n_tokens, sampling, size) if FLAGS.predict else {}),
          "median_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in runs),
          "median_mean_accepted": statistics.median(accepted) if accepted else None,
          "median_prefill_s": statistics.median(x["prefill_s"] for x in runs)})
      rows += [peer_row(peer, n_tokens, peer_runs[peer]) for peer in beside]
      if common.writes_outputs():
        pathlib.Path(FLAGS.out).write_text(json.dumps(record(rows), indent=2))  # survives a crash
    if FLAGS.temperature == 0:   # sampled tokens differ from ar's by their random numbers alone
      compare_with_ar(rows, groups, n_tokens, size, ar_tokens, greedy_tokens, margins_of, tie)
    if size == 1 and not any(m.label == "ar" for m in planned):  # no `ar` to time them beside: after the methods
      for peer in peer_engines:
        peer_warm_up(peer, n_tokens, groups[0][0], progress)
        rows.append(peer_row(peer, n_tokens, [peer_run(peer, n_tokens, i, group[0], ar_tokens, next(order), progress)
                                              for i, group in enumerate(groups)]))
        if common.writes_outputs():
          pathlib.Path(FLAGS.out).write_text(json.dumps(record(rows), indent=2))
  write_outputs(record(rows))
  for r in rows:
    for d in r.get("differs_from_ar", []):
      print(f"{r['method']}: prompt {d['prompt']} of {r['prompt_tokens']} tokens {near_ties.describe(d)}")
  fail_on_faults(rows, tie, lambda d: f"prompt {d['prompt']}")


def compare_with_ar(rows, groups, n_tokens: int, size: int, ar_tokens: dict, greedy_tokens: dict, margins_of,
                    tie: float) -> None:
  """Greedy decoding: each method's tokens on each prompt of this length and batch size against
  `ar`'s, row by row, as its row's differs_from_ar (near_ties.compare: where it parts, the
  target's margin there, and whether a near-tie explains it). Nothing to compare without `ar`."""
  from hitree_jax import near_ties
  if not any(key[:2] == (n_tokens, size) for key in ar_tokens):
    return
  for row in rows:
    if (row["prompt_tokens"] != n_tokens or row.get("batch_size", 1) != size or row["method"] == "ar"
        or row.get("peer")):
      continue
    row["differs_from_ar"] = []
    for i, group in enumerate(groups):
      mine, theirs = greedy_tokens[row["method"], n_tokens, size, i], ar_tokens[n_tokens, size, i]
      for k, ids in enumerate(group):
        parted = near_ties.compare(list(ids), mine[k], theirs[k], margins_of, tie)
        if parted is not None:
          row["differs_from_ar"].append({"prompt": i, **({"row": k} if size != 1 else {}), **parted})


def fail_on_faults(rows, tie: float, where) -> None:
  """Exits non-zero, after the record is written, on a fault (near_ties.fault_message)."""
  from hitree_jax import near_ties
  message = near_ties.fault_message(rows, tie, where)
  if message:
    raise SystemExit(message)


def planned_auto(model, n_tokens: int, sampling, size: int, text: str):
  """`auto` planned for prompts of `n_tokens` and batches of `size`, its draft loaded; its label
  says what it was planned for."""
  method = methods_lib.auto_method(FLAGS.model, FLAGS.draft, n_tokens, sampling, loaded=(model, None),
                                   feature_draft=FLAGS.feature_draft, text=text, batch=size
                                   ).load_draft(model.config, model.params)
  return method if text != CHAT else dataclasses.replace(
      method, label=f"{method.label} (planned for {n_tokens} prompt tokens)")


def prediction(model, method, n_tokens: int, sampling, size: int) -> dict:
  """The planner's prediction for this method's stack at this length and batch size, in tokens
  per second over all rows ({} for ar, or a stack outside the profile's levels: say why in the log)."""
  if method.levels is None:
    return {}
  from hitree_jax.planner import auto
  eagle = methods_lib.check_auto_draft(FLAGS.draft, FLAGS.feature_draft)
  profile, _ = auto.profiled(FLAGS.model, FLAGS.draft, auto.nearest_context(n_tokens), sampling,
                             text=FLAGS.text, loaded=(model, None), log=logging.info, eagle=eagle,
                             dtype=model.config.dtype, key_dtype=model.config.key_dtype,
                             batch=auto.nearest_batch(size))
  try:
    got = auto.predict(profile, FLAGS.temperature == 0,
                       auto.in_profile_names(method.levels, FLAGS.draft, eagle), method.tree)
  except ValueError as e:
    logging.info("no prediction for %s: %s", method.label, e)
    return {}
  return {"predicted_tokens_per_s": size / got.seconds_per_token,   # over all rows, as measured
          "predicted_tokens_per_target_forward": got.tokens_per_target_forward}


def make_peers(model_path, longest_prompt: int) -> list:
  """The --peers engines, loaded once (llama.cpp's context fits the longest prompt)."""
  from . import peers
  context = longest_prompt + FLAGS.max_new_tokens + 16
  made = []
  for name in FLAGS.peers:
    if name == "llamacpp":
      made += [peers.make_peer(name, model_path, path, context, cache)
               for path in FLAGS.llamacpp_gguf or [None] for cache in FLAGS.llamacpp_cache]
    else:
      made.append(peers.make_peer(name, model_path, None, context))
  return made


def _peer_settings() -> dict:
  return dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
              top_k=FLAGS.top_k, seed=FLAGS.seed)


def peer_warm_up(peer, n_tokens: int, first_prompt, progress) -> None:
  peer.run(first_prompt, **_peer_settings())
  progress.step(detail=f"{peer.label} P={n_tokens} warm-up")


def peer_run(peer, n_tokens: int, i: int, ids, ar_tokens: dict, order: int, progress) -> dict:
  """One timed run of a peer on prompt i (greedy: how many leading tokens equal `ar`'s)."""
  r = peer.run(ids, **_peer_settings())
  new = len(r.tokens)
  run = {"prompt": i, "order": order, "prefill_s": r.prefill_s, "decode_s": r.decode_s, "new_tokens": new,
         "decode_tokens_per_s": (new - 1) / r.decode_s, "mean_accepted": None}
  ours = ar_tokens.get((n_tokens, 1, i), [None])[0]
  if FLAGS.temperature == 0 and ours is not None:  # sampled tokens differ by random numbers alone
    run["same_tokens_as_ar"] = next((k for k, (a, b) in enumerate(zip(ours, r.tokens)) if a != b),
                                    min(len(ours), new))
  progress.step(detail=f"{peer.label} P={n_tokens} prompt {i}: {run['decode_tokens_per_s']:.2f} tok/s")
  return run


def peer_row(peer, n_tokens: int, runs: list[dict]) -> dict:
  """A peer's row, shaped like a method's."""
  return {"method": peer.label, "prompt_tokens": n_tokens, "runs": runs, "compile_s": None, "peer": True,
          "median_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in runs),
          "median_mean_accepted": None,
          "median_prefill_s": statistics.median(x["prefill_s"] for x in runs)}


def record(rows) -> dict:
  """The JSON record: the settings, the machine (its CPU, jax and the commit) and one row per
  (method, prompt length)."""
  import jax
  from hitree_jax import provenance
  return {**provenance.stamp(),
      "model": FLAGS.model, "dtype": common.model_dtype(), "key_dtype": FLAGS.key_dtype, "max_new_tokens": FLAGS.max_new_tokens,
      "text": FLAGS.text, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
      "top_k": FLAGS.top_k, "seed": FLAGS.seed, **({"seeds": FLAGS.seeds} if FLAGS.seeds > 1 else {}),
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()], "mesh": FLAGS.mesh or None, "machine": platform.processor() or platform.machine(),
      "memory_pages": huge_pages.describe(),
      "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": rows}


def run():
  common.run(main)


if __name__ == "__main__":
  run()
