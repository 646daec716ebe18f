"""How long a continuation must a book profile take acceptance over? Prompt lookup matches what the
target wrote earlier in its own answer, so it accepts more late in a long generation than over a
profile's first 64 tokens. For the three 512-token Austen passages a profile and launch.benchmark
both use, greedy: SmolLM2's own 128-token continuations, the prompt-lookup pair's acceptance over
their first 64 and over all 128 tokens, and the tokens per target forward the planner then
predicts for prompt lookup's chains, beside what launch.benchmark measured on 128 new tokens.

  python docs/results/planner/continuation_length.py PROFILE.json BENCHMARK.json

PROFILE.json: a kept profile of these models at 512 tokens, greedy; BENCHMARK.json: a
launch.benchmark record at 512 tokens, greedy, 128 new tokens, with `hsd/ngram:3/chain:N` rows.
"""

import json
import sys

from hitree_jax import provenance
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.planner import auto
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tokenizer import load_tokenizer

PAIR = (auto.TARGET, auto.level_named("ngram:3"))


def main():
  profile = json.load(open(sys.argv[1]))["profile"]
  bench = {r["method"]: r for r in json.load(open(sys.argv[2]))["results"]}
  target = load_model("smollm2")
  greedy = SamplingParams.create()
  prompts = auto.measured_prompts(load_tokenizer(target.path), "austen", 512)
  continuations = [engine.generate(target.params, target.config, [p], max_new_tokens=128, stop_at_eos=False).tokens[0]
                   for p in prompts]
  rows = {}
  for n in (64, 128):
    measured = [profile_lib.pair_acceptance(target, None, [PAIR], p, c[:n], greedy) for p, c in zip(prompts, continuations)]
    record = auto._mean([m["target<-ngram:3"] for m in measured])
    planted = dict(profile, acceptance=dict(profile["acceptance"], **{"target<-ngram:3": record}))
    rows[n] = {"greedy": record["greedy"], "offered": record.get("offered"),
               "tau": {chain: auto.predict(planted, True, f"ngram:3/chain:{chain}").tokens_per_target_forward
                       for chain in (2, 3, 6)}}
  print("| acceptance over | greedy agreement | chain of 2: predicted tau | chain of 3 | chain of 6 |")
  print("|---|---|---|---|---|")
  for n, row in rows.items():
    print(f"| the first {n} tokens | {row['greedy']:.3f} | " + " | ".join(f"{row['tau'][c]:.2f}" for c in (2, 3, 6)) + " |")
  measured_tau = {c: bench.get(f"hsd/ngram:3/chain:{c}", {}).get("median_mean_accepted") for c in (2, 3, 6)}
  print("| measured, 128 new tokens | | " + " | ".join("-" if t is None else f"{t:.2f}" for t in measured_tau.values()) + " |")
  print(json.dumps({**provenance.stamp(), "rows": rows, "measured_tau": measured_tau}))


if __name__ == "__main__":
  main()
