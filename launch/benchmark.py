"""Decode speed on deterministic book prompts, written as JSON (and a markdown table).

  python -m launch.benchmark --model=smollm2 --methods=ar --prompt_tokens=512,2048,6000 \
      --new_tokens=128 --n_prompts=3 --out=results.json
  python -m launch.benchmark --methods=ar,sd/ngram/4,tree/self:8/kary:2x2 --prompt_tokens=512 \
      --temperature=0.6 --top_p=0.9

Each (method, prompt length) is compiled and warmed up on its first prompt
before anything is timed; EOS is ignored so every run decodes exactly
--new_tokens tokens. Speeds are decode tokens/s (prefill excluded).
"""

from __future__ import annotations

import json
import platform
import statistics
import time

from absl import app, flags, logging

from launch import common

common.define_model_flags()
common.define_sampling_flags()
common.define_speculation_flags()
flags.DEFINE_list("methods", ["ar"], "Configurations to compare: ar, sd[/DRAFT[/GAMMA]], "
                  "tree[/DRAFT[/TREE]] (missing parts from --draft, --gamma, --tree).")
flags.DEFINE_list("prompt_tokens", ["512", "2048"], "Prompt lengths in tokens.")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("n_prompts", 3, "Prompts per length.")
flags.DEFINE_enum("corpus", "austen", ["austen", "shakespeare", "milton"], "Book corpus of the prompts.")
flags.DEFINE_string("out", "results.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS


def run_one(model, method, ids, sampling):
  return method.generate(model.params, model.config, [ids], max_new_tokens=FLAGS.new_tokens,
                         sampling=sampling, seed=FLAGS.seed, stop_at_eos=False)


def markdown(rows) -> str:
  lines = ["| method | prompt tokens | decode tok/s (median) | speedup vs ar | mean accepted | prefill s | compile s |",
           "|---|---|---|---|---|---|---|"]
  base = {r["prompt_tokens"]: r["median_decode_tokens_per_s"] for r in rows if r["method"] == "ar"}
  for r in rows:
    speedup = r["median_decode_tokens_per_s"] / base[r["prompt_tokens"]] if r["prompt_tokens"] in base else float("nan")
    accepted = r["median_mean_accepted"]
    lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r['median_decode_tokens_per_s']:.2f} | "
                 f"{speedup:.2f}x | {accepted if accepted is None else f'{accepted:.2f}'} | "
                 f"{r['median_prefill_s']:.2f} | {r['compile_s']:.1f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  greedy = FLAGS.temperature == 0
  methods = [common.parse_method(m, FLAGS.draft, FLAGS.gamma, FLAGS.tree, FLAGS.acceptance, greedy)
             for m in common.join_method_specs(FLAGS.methods)]
  sampling = common.sampling_from_flags(FLAGS)
  import jax
  from hitree_jax.data import book_prompts
  from hitree_jax.loading import load_model
  from hitree_jax.tokenizer import load_tokenizer

  model = load_model(FLAGS.model, FLAGS.dtype)
  tokenizer = load_tokenizer(model.path)
  methods = [method.load_draft(model.config) for method in methods]
  rows = []
  for n_tokens in map(int, FLAGS.prompt_tokens):
    prompts = book_prompts(tokenizer, n_tokens, FLAGS.n_prompts, corpus=FLAGS.corpus)
    for method in methods:
      warm = run_one(model, method, prompts[0], sampling)  # compiles; not timed
      runs = []
      for i, ids in enumerate(prompts):
        r = run_one(model, method, ids, sampling)
        runs.append({"prompt": i, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
                     "new_tokens": len(r.tokens[0]), "decode_tokens_per_s": r.decode_tokens_per_s,
                     "compiles": r.compiles, "target_forwards": r.target_forwards,
                     "mean_accepted": r.mean_accepted, "accepted_per_depth": r.accepted_per_depth})
        logging.info("%s P=%d prompt %d: %.2f tok/s", method.label, n_tokens, i, r.decode_tokens_per_s)
      accepted = [x["mean_accepted"] for x in runs if x["mean_accepted"] is not None]
      rows.append({
          "method": method.label, "prompt_tokens": n_tokens, "runs": runs, "compile_s": warm.compile_s,
          "median_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in runs),
          "median_mean_accepted": statistics.median(accepted) if accepted else None,
          "median_prefill_s": statistics.median(x["prefill_s"] for x in runs)})
  record = {
      "model": FLAGS.model, "dtype": FLAGS.dtype, "new_tokens": FLAGS.new_tokens,
      "corpus": FLAGS.corpus, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
      "top_k": FLAGS.top_k, "seed": FLAGS.seed, "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()], "machine": platform.processor() or platform.machine(),
      "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": rows}
  with open(FLAGS.out, "w") as f:
    json.dump(record, f, indent=2)
  table = markdown(rows)
  with open(FLAGS.out.rsplit(".", 1)[0] + ".md", "w") as f:
    f.write(table + "\n")
  print(table)


if __name__ == "__main__":
  app.run(main)
