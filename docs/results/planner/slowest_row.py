"""A batch benchmark's rows against the planner, cell by cell: the rounds each batch took over
those of its mean row (its tokens over the rows' tokens per target forward), against what the
model charges for the slowest row (auto.for_the_batch); and the measured tokens per second
against the prediction with and without that charge. Reads launch.benchmark's JSON (made with
--predict) and the profiles it planned from.

  HITREE_PROFILES=DIRECTORY python docs/results/planner/slowest_row.py RECORD.json [--sampled]
"""

import json
import sys

import numpy as np

from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.planner import auto

DRAFT = "drafts/smollm2-draft.gguf"


def main():
  record = json.load(open(sys.argv[1]))
  greedy = "--sampled" not in sys.argv
  sampling = SamplingParams.create() if greedy else SamplingParams.create(0.6, 0.9)
  print("| method | batch | rounds / mean row's: measured | charged | tok/s measured | predicted | error | "
        "without the slowest row | error |")
  print("|---|---|---|---|---|---|---|---|---|")
  for result in record["results"]:
    batch = result.get("batch_size") or 1
    if result.get("predicted_tokens_per_s") is None:
      continue
    levels = result["method"].removeprefix("auto=").removeprefix("hsd/")
    profile, _ = auto.profiled("smollm2", DRAFT, auto.nearest_context(result["prompt_tokens"]), sampling,
                               batch=auto.nearest_batch(batch))
    with_row = auto.predict(profile, greedy, levels)
    mean_row = auto.predict({k: v for k, v in profile.items() if k != "per_continuation"}, greedy, levels)
    runs = [r for r in result["runs"] if r.get("target_forwards")]
    ratio = np.median([r["target_forwards"] / (r["new_tokens"] / batch / r["mean_accepted"]) for r in runs])
    measured = result["median_decode_tokens_per_s"]
    predicted, plain = batch / with_row.seconds_per_token, batch / mean_row.seconds_per_token
    print(f"| {result['method']} | {batch} | {ratio:.2f} | {with_row.seconds_per_token / mean_row.seconds_per_token:.2f} | "
          f"{measured:.1f} | {predicted:.1f} | {predicted / measured - 1:+.0%} | {plain:.1f} | {plain / measured - 1:+.0%} |")


if __name__ == "__main__":
  main()
