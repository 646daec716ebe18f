"""Prompt lookup's variants replayed over `ar`'s greedy answers to Spec-Bench's summarization
questions: tokens per round (τ) and the tokens per unit of forward cost they would give.

The replay follows hitree_jax/decode/drafters.py's NGramDrafter: the latest earlier occurrence
of the longest suffix of min..max tokens, offering at most cap(n) tokens after a match of n,
verified at the narrowest of offer_widths that holds the offer. With the shipped rule (1-3
tokens, cap 2**n, chain of 8) it gives τ 2.25 against the 2.27 the engine measured on the same
questions (results/specbench/specbench_10.*). The cost of a w-token forward relative to a 1-token one is
a rough figure for this CPU (launch.step_cost; a 9-token round measured 1.58-1.68x), so read
the last column only as a comparison between variants.

  python docs/results/cpu/lookup_replay.py summarization 20 answers.json > docs/results/cpu/lookup_replay.txt
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from hitree_jax.tree.shapes import offer_widths  # noqa: E402

RELATIVE_COST = {1: 1.0, 3: 1.2, 5: 1.35, 9: 1.65, 17: 2.3}   # a forward of w tokens over one of 1


def ar_answers(tasks: list[str], per_task: int) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, `ar`'s greedy answer) per turn, as launch.benchmark --text=chat asks."""
  from hitree_jax import methods, spec_bench
  from hitree_jax.loading import load_model
  from hitree_jax.tokenizer import load_tokenizer
  from launch.spec_bench_run import answer
  model = load_model("smollm2", "float32")
  tokenizer, ar = load_tokenizer(model.path), methods.method("ar")
  return [(turn["prompt"], turn["tokens"])
          for question in spec_bench.select(spec_bench.read(None), tasks, per_category=per_task)
          for turn in answer(model, tokenizer, ar, question, None, None, None, 256, seed=0)]


def offer(history: list[int], min_n: int, max_n: int, size: int, cap) -> list[int]:
  """What the drafter offers: the tokens after the latest earlier match of the longest suffix."""
  best, matched = -1, 0
  for n in range(1, max_n + 1):
    suffix = history[len(history) - n:]
    ends = [e for e in range(n - 1, len(history) - 1) if history[e - n + 1:e + 1] == suffix]
    if not ends:
      break
    if n >= min_n:
      best, matched = ends[-1], n
  if best < 0:
    return []
  return history[best + 1:best + 1 + min(size, len(history) - 1 - best, cap(matched))]


def replay(turns, min_n: int, max_n: int, size: int, cap) -> tuple[float, float]:
  """(tokens per round, tokens per unit of forward cost) over the turns."""
  tokens = rounds = 0
  cost = 0.0
  for prompt, answer in turns:
    history, i = list(prompt), 0
    while i < len(answer):
      offered = offer(history, min_n, max_n, size, cap)
      kept = 0
      while kept < len(offered) and i + kept < len(answer) and offered[kept] == answer[i + kept]:
        kept += 1
      take = min(kept + 1, len(answer) - i)
      width = min(w for w in offer_widths(size) if w >= len(offered))
      cost += RELATIVE_COST[width + 1]
      rounds += 1
      history += answer[i:i + take]
      i += take
      tokens += take
  return tokens / rounds, tokens / cost


VARIANTS = [  # (min n, max n, chain, cap name, cap)
    (1, 3, 8, "2^n", lambda n: 2 ** n),    # the shipped rule
    (1, 5, 8, "2^n", lambda n: 2 ** n),
    (1, 6, 8, "2^n", lambda n: 2 ** n),
    (2, 3, 8, "2^n", lambda n: 2 ** n),
    (1, 3, 4, "2^n", lambda n: 2 ** n),
    (1, 5, 16, "2^n", lambda n: 2 ** n),
    (1, 3, 8, "none", lambda n: 8),
    (1, 3, 8, "1, 2, 8", lambda n: {1: 1, 2: 2}.get(n, 8)),
    (1, 3, 8, "2, 8, 8", lambda n: {1: 2}.get(n, 8)),
    (1, 3, 8, "2, 2, 8", lambda n: {1: 2, 2: 2}.get(n, 8)),
]


def main():
  tasks, per_task, cached = sys.argv[1].split(","), int(sys.argv[2]), pathlib.Path(sys.argv[3])
  if not cached.exists():
    cached.write_text(json.dumps(ar_answers(tasks, per_task)))
  turns = json.loads(cached.read_text())
  print(f"# {len(turns)} turns of {', '.join(tasks)}, {sum(len(a) for _, a in turns)} answer tokens")
  print("| n-gram | chain | cap after a match of n | τ | tokens per unit of cost |")
  print("|---|---|---|---|---|")
  for min_n, max_n, size, name, cap in VARIANTS:
    tau, per_cost = replay(turns, min_n, max_n, size, cap)
    print(f"| {min_n}-{max_n} | {size} | {name} | {tau:.3f} | {per_cost:.3f} |")


if __name__ == "__main__":
  main()
