"""How close to a tie the target's greedy choice is where the H100's speculative run left `ar`.

On the H100 (docs/results/specbench_gpu_h100.*), `sd/ngram/8` in float32 differed from `ar` in
5 of 24 Spec-Bench turns. This replays `ar` for those turns here, in float32 on the CPU, and
gives the margin between the target's two best logits at the token where each run parted, set
against the margins at every other token of the same turns. A margin far below the typical one
at exactly those tokens says the runs parted on a near-tie: a different rounding (the GPU's
default float32 products use TF32's 10-bit mantissa) picks the other token.

  JAX_PLATFORMS=cpu python docs/results/gpu_near_ties.py > docs/results/gpu_near_ties.txt
"""

import numpy as np

from hitree_jax import methods, spec_bench
from hitree_jax.loading import load_model
from hitree_jax.near_ties import top2_margins
from hitree_jax.tokenizer import conversation_prompt, load_tokenizer

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
    question, answers = questions[qid], []
    for t in range(len(question.turns)):
      ids = conversation_prompt(tokenizer, question.turns[:t + 1], answers)
      tokens = ar.generate(model.params, model.config, [ids], max_new_tokens=MAX_NEW_TOKENS,
                           stop_at_eos=True).tokens[0]
      answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
      m = top2_margins(model.params, model.config, ids, tokens)[:-1]   # the rows that chose them
      every.append(m)
      for q, turn, at in PARTINGS:
        if (q, turn) == (qid, t + 1):
          smaller = int((m < m[at]).sum())
          at_parting.append(m[at])
          print(f"question {qid} turn {turn} token {at}: margin {m[at]:.4f}; "
                f"{smaller} of this turn's {len(m)} margins are smaller")
  every = np.concatenate(every)
  print(f"all {len(every)} tokens of these turns: median margin {np.median(every):.3f}, "
        f"5th percentile {np.percentile(every, 5):.4f}, 1st {np.percentile(every, 1):.4f}")
  print(f"at the 5 partings: largest margin {max(at_parting):.4f}")


if __name__ == "__main__":
  main()
