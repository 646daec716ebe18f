"""Prompt lookup's tokens per target forward as the planner predicts them: from acceptance taken
position by position (the model of independent positions, latency.first_round with the offered
law) and from its rounds replayed over the target's own continuation (profile.ngram_rounds), over
the first 64 and all 128 tokens of the continuations a profile takes, against what
launch.benchmark measured on the same passages (pooled: all their tokens after the prefill's over
all their target forwards, as a replay counts them). Greedy, the replay over the 128 tokens the
benchmark generates is the engine's own rounds; sampled, one sample of the text stands for all.

  python docs/results/planner/ngram_replay.py CONTEXT TEMPERATURE [BENCHMARK.json ...]

TEMPERATURE 0 is greedy; otherwise top-p 0.9, as the grid's sampled cells. BENCHMARK.json: records
at that length and sampling with prompt-lookup rows (hsd/ngram:3/chain:N or sd/ngram/N).
"""

import json
import re
import sys

import numpy as np

from hitree_jax import provenance
from hitree_jax.data import book_prompts
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.planner import auto, latency
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tokenizer import load_tokenizer
from hitree_jax.tree import shapes

CHAINS = (2, 3, 4, 6, 8)
PAIR = (auto.TARGET, auto.level_named("ngram:3"))


def independent_tau(record: dict, greedy: bool, n: int) -> float:
  """latency.first_round's yield, positions independent (the planner before replay)."""
  offer = record["offered"]
  profile = [r / max(offer, 1e-9) for r in record["greedy_profile" if greedy else "profile"]]
  law, _ = latency.first_round(lambda w: 1.0, shapes.chain(n), profile, latency.Overheads(),
                               offer=tuple(record["offered_counts"]))
  return latency.expected(law, float)


def replayed_tau(records: list, n: int) -> float:
  """Tokens per round, pooled over the passages' replayed rounds."""
  r = sum(np.asarray(record["rounds"][str(n)]) for record in records)
  return float((r.sum(axis=0) * (np.arange(r.shape[1]) + 1)).sum() / r.sum())


def measured(paths) -> tuple[dict, set]:
  """{chain: tokens per target forward, pooled over the record's passages}, and those passages:
  each run's tokens after the prefill's first over its target forwards, as a replay counts them."""
  out, passages = {}, set()
  for path in paths:
    for row in json.load(open(path))["results"]:
      m = re.fullmatch(r"(?:hsd/ngram:3/chain:|sd/ngram/)(\d+)", row["method"])
      if m:
        runs = row["runs"]
        out[int(m.group(1))] = sum(r["new_tokens"] - 1 for r in runs) / sum(r["target_forwards"] for r in runs)
        passages |= {r["prompt"] for r in runs}
  return out, passages


def main():
  context, temperature = int(sys.argv[1]), float(sys.argv[2])
  sampling = SamplingParams.create(temperature=temperature, top_p=0.9 if temperature else 1.0)
  target = load_model("smollm2")
  bench, passages = measured(sys.argv[3:])
  # The benchmark's passages: book_prompts spaces them by how many it cuts (--n_prompts).
  n_prompts = max(passages) + 1 if passages else auto.passages(context)
  prompts = book_prompts(load_tokenizer(target.path), context, n_prompts)
  runs = [engine.generate(target.params, target.config, [p], sampling=sampling, seed=i, max_new_tokens=128,
                          stop_at_eos=False).tokens[0] for i, p in enumerate(prompts)]
  passages = sorted(passages) or list(range(len(prompts)))
  rows = {}
  for length in (64, 128):
    records = [profile_lib.pair_acceptance(target, None, [PAIR], prompts[i], runs[i][:length], sampling,
                                           chains=CHAINS)["target<-ngram:3"] for i in passages]
    mean = auto._mean(records)
    rows[length] = {n: {"independent": independent_tau(mean, temperature == 0, n),
                        "replayed": replayed_tau(records, n)} for n in CHAINS}
  print(f"passages {passages}")
  print("| chain | independent, 64 | replayed, 64 | independent, 128 | replayed, 128 | measured |")
  print("|---|---|---|---|---|---|")
  for n in CHAINS:
    cells = [f"{rows[l][n][k]:.2f}" for l in (64, 128) for k in ("independent", "replayed")]
    print(f"| {n} | " + " | ".join(cells) + (f" | {bench[n]:.2f} |" if n in bench else " | - |"))
  print(json.dumps({**provenance.stamp(), "context": context, "temperature": temperature, "rows": rows,
                    "passages": passages, "measured": bench}))


if __name__ == "__main__":
  main()
