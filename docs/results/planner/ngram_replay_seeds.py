"""How much one sample of the target's text says about prompt lookup under sampling: for each of
the three 512-token Austen passages and five seeds, prompt lookup's chain of 4 replayed over `ar`'s
128-token sample (profile.ngram_rounds), and the engine's own tokens per target forward with
sd/ngram/4 at that seed, T 0.6 / top-p 0.9.

  python docs/results/planner/ngram_replay_seeds.py [SEEDS]
"""

import json
import sys

import numpy as np

from hitree_jax import methods, provenance
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.planner import auto
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tokenizer import load_tokenizer

PAIR, CHAIN, NEW = (auto.TARGET, auto.level_named("ngram:3")), 4, 128


def tau(rounds) -> float:
  r = np.asarray(rounds)
  return float((r.sum(axis=0) * (np.arange(r.shape[1]) + 1)).sum() / r.sum())


def main():
  seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
  target = load_model("smollm2")
  sampling = SamplingParams.create(temperature=0.6, top_p=0.9)
  prompts = auto.measured_prompts(load_tokenizer(target.path), "austen", 512)
  lookup = methods.method(f"sd/ngram/{CHAIN}", greedy=False).load_draft(target.config, target.params)
  rows = []
  for seed in range(seeds):
    for i, prompt in enumerate(prompts):
      text = engine.generate(target.params, target.config, [prompt], sampling=sampling, seed=seed,
                             max_new_tokens=NEW, stop_at_eos=False).tokens[0]
      record = profile_lib.pair_acceptance(target, None, [PAIR], prompt, text, sampling, chains=(CHAIN,))
      run = lookup.generate(target.params, target.config, [prompt], max_new_tokens=NEW, sampling=sampling,
                            seed=seed, stop_at_eos=False)
      rows.append({"seed": seed, "passage": i, "replayed": tau(record["target<-ngram:3"]["rounds"][str(CHAIN)]),
                   "engine": (len(run.tokens[0]) - 1) / run.target_forwards})
      print(rows[-1], flush=True)
  for name in ("replayed", "engine"):
    values = [r[name] for r in rows]
    print(f"{name}: mean {np.mean(values):.2f}, min {min(values):.2f}, max {max(values):.2f}, "
          f"sd of one sample {np.std(values, ddof=1):.2f}")
  print(json.dumps({**provenance.stamp(), "chain": CHAIN, "new_tokens": NEW, "rows": rows}))


if __name__ == "__main__":
  main()
