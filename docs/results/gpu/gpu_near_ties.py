"""How close to a tie the target's greedy choice is where the H100's speculative run left `ar`.

On the H100 (docs/results/specbench/specbench_gpu_h100.*), `sd/ngram/8` in float32 differed from `ar` in
5 of 24 Spec-Bench turns. This replays `ar` for those turns here, in float32 on the CPU, and
gives the margin between the target's two best logits at the token where each run parted, set
against the margins at every other token of the same turns. A margin far below the typical one
at exactly those tokens says the runs parted on a near-tie: a different rounding (the GPU's
default float32 products use TF32's 10-bit mantissa) picks the other token.

  JAX_PLATFORMS=cpu python docs/results/gpu/gpu_near_ties.py > docs/results/gpu/gpu_near_ties.txt
"""

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from hitree_jax import methods, spec_bench  # noqa: E402
from hitree_jax.loading import load_model  # noqa: E402
from hitree_jax.near_ties import parting, top2_margins  # noqa: E402
from hitree_jax.tokenizer import load_tokenizer  # noqa: E402
from launch.spec_bench_run import answer  # noqa: E402

# (question_id, turn, first differing token) from the H100 run's report.
PARTINGS = [(83, 1, 192), (84, 1, 184), (84, 2, 43), (401, 1, 128), (483, 1, 42)]
MAX_NEW_TOKENS = 256


def main():
  model = load_model("smollm2", "float32")
  tokenizer = load_tokenizer(model.path)
  ar = methods.method("ar")
  questions = {q.question_id: q for q in spec_bench.read(None)}
  every, at_parting = [], []
  for qid in sorted({q for q, _, _ in PARTINGS}):
    turns = answer(model, tokenizer, ar, questions[qid], None, None, None, MAX_NEW_TOKENS, seed=0)
    for t, turn_run in enumerate(turns):
      m = top2_margins(model.params, model.config, turn_run["prompt"], turn_run["tokens"])[:-1]  # rows that chose them
      every.append(m)
      for q, turn, at in PARTINGS:
        if (q, turn) == (qid, t + 1):
          d = parting(m, at)
          at_parting.append(d["margin"])
          print(f"question {qid} turn {turn} token {at}: margin {d['margin']:.4f}; "
                f"{d['smaller_in_answer']} of this turn's {len(m)} margins are smaller")
  every = np.concatenate(every)
  print(f"all {len(every)} tokens of these turns: median margin {np.median(every):.3f}, "
        f"5th percentile {np.percentile(every, 5):.4f}, 1st {np.percentile(every, 1):.4f}")
  print(f"at the 5 partings: largest margin {max(at_parting):.4f}")


if __name__ == "__main__":
  main()
