"""How many samples of the target's text must a sampled profile take acceptance over? Reads a
sampled profile (its `per_continuation`: each passage's samples, in order) and predicts from
every choice of K samples of each passage, K = 1 .. all: what the planner chooses, and the
spread of its predictions for a few stacks against those from all the samples.

  python docs/results/planner/samples_at_length.py PROFILE.json

PROFILE.json: a kept profile (auto.profiled's file, e.g. first_profile_phases.py's at 7,680
--sampled). The last line printed is the record as JSON.
"""

import itertools
import json
import sys

import numpy as np

from hitree_jax import provenance
from hitree_jax.planner import auto

STACKS = ("ngram:3/chain:2", "ngram:3/chain:4", "draft@streaming:16x234/chain:2", "draft/chain:2")


def predictions(profile: dict) -> dict:
  ar = profile["ar_seconds"]
  choice = auto.choose(profile, greedy=False)
  return {"chose": str(choice.levels) if choice.levels else "ar", "chose_x_ar": choice.predicted_tokens_per_s * ar,
          **{stack: ar / auto.predict(profile, False, stack).seconds_per_token for stack in STACKS}}


def main():
  profile = json.load(open(sys.argv[1]))["profile"]
  each, passages = profile["per_continuation"], profile["passages"]
  per = len(each) // passages
  of_passage = [each[i * per:(i + 1) * per] for i in range(passages)]
  whole = predictions(profile)
  print("all", per, "a passage:", whole["chose"], {s: round(whole[s], 3) for s in STACKS})
  out = {"all": whole}
  for k in range(1, per):
    picks = list(itertools.product(*[itertools.combinations(samples, k) for samples in of_passage]))
    got = []
    for pick in picks:
      chosen = [c for group in pick for c in group]
      got.append(predictions({**profile, "acceptance": auto._mean([c["acceptance"] for c in chosen]),
                              "per_continuation": chosen, "continuations": len(chosen)}))
    off = {s: float(np.max(np.abs([g[s] / whole[s] - 1 for g in got]))) for s in STACKS}
    chose = {name: sum(g["chose"] == name for g in got) for name in {g["chose"] for g in got}}
    out[k] = {"choices": len(got), "chose": chose, "largest_deviation": off}
    print(f"{k} a passage ({len(got)} choices): chose {chose}; largest deviation from all: "
          + ", ".join(f"{s} {off[s]:.1%}" for s in STACKS), flush=True)
  print(json.dumps({**provenance.stamp(), "profile": sys.argv[1], "context": profile["context"],
                    "samples_per_passage": per, "predictions": out}))


if __name__ == "__main__":
  main()
