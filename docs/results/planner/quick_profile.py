"""Does a quick profile predict as a full one does? For two profiles of the same models, context
and sampling (a full one: five widths, ten repeats, its own fit of the overheads; a quick one: the
default), the planner's choice and its predicted speed over `ar` for a list of stacks, from:

  full     the full profile as it is
  quick    the quick profile as it is (its widths, its repeats, the shipped or a borrowed fit, and
           `ar` read from its continuations)
  costs    the full profile with the quick one's forwards' costs alone (what the fewer widths and
           repeats change)

  python docs/results/planner/quick_profile.py FULL.json QUICK.json [BENCHMARK.json]

Greedy. With a launch.benchmark record of the same setting (its methods `hsd/STACK`), also each
profile's predicted speed over `ar` against the measured one. Prints markdown tables, then the
record as JSON (machine, jax, commit, command).
"""

import statistics

import json
import sys

from hitree_jax import provenance
from hitree_jax.planner import auto

STACKS = ("ngram:3/chain:2", "ngram:3/chain:3", "ngram:3/chain:6", "draft/chain:1", "draft/chain:2", "draft/chain:4",
          "draft/kary:2x2", "self:8/chain:2", "ngram:3/chain:2+draft/3")


def main():
  full, quick = (json.load(open(path))["profile"] for path in sys.argv[1:3])
  greedy = True
  profiles = {"full": full, "quick": quick, "costs": dict(full, costs=quick["costs"])}
  speed = lambda profile, stack: profile["ar_seconds"] / auto.predict(profile, greedy, stack).seconds_per_token
  rows = {stack: {name: speed(profile, stack) for name, profile in profiles.items()} for stack in STACKS}
  chosen = {name: str(auto.choose(profile, greedy).levels or "ar") for name, profile in profiles.items()}
  print("| stack | full | quick | quick / full | costs | costs / full |")
  print("|---|---|---|---|---|---|")
  for stack, x in rows.items():
    print(f"| {stack} | {x['full']:.3f}x | {x['quick']:.3f}x | {x['quick'] / x['full']:.3f} | {x['costs']:.3f}x "
          f"| {x['costs'] / x['full']:.3f} |")
  print(f"| chosen | {chosen['full']} | {chosen['quick']} | | {chosen['costs']} | |")
  print(f"| `ar` ms/token | {full['ar_seconds'] * 1e3:.2f} | {quick['ar_seconds'] * 1e3:.2f} | | | |")
  measured = against_measurement(json.load(open(sys.argv[3])), profiles, speed) if len(sys.argv) > 3 else None
  print(json.dumps({**provenance.stamp(), "profiles": sys.argv[1:3], "greedy": greedy, "predicted_x_ar": rows,
                    "chosen": chosen, "ar_seconds": {"full": full["ar_seconds"], "quick": quick["ar_seconds"]},
                    "against_measurement": measured}))


def against_measurement(record: dict, profiles: dict, speed) -> dict:
  """Each hsd/STACK of a benchmark record: measured x `ar` (medians), and each profile's prediction."""
  tok_s = {r["method"]: r["median_decode_tokens_per_s"] for r in record["results"]}
  out = {}
  print("\n| stack | measured x ar | full predicts | error | quick predicts | error |")
  print("|---|---|---|---|---|---|")
  for method, value in tok_s.items():
    if not method.startswith("hsd/"):
      continue
    stack, x = method.removeprefix("hsd/"), value / tok_s["ar"]
    full, quick = speed(profiles["full"], stack), speed(profiles["quick"], stack)
    out[stack] = {"measured": x, "full": full, "quick": quick}
    print(f"| {stack} | {x:.3f}x | {full:.3f}x | {full / x - 1:+.0%} | {quick:.3f}x | {quick / x - 1:+.0%} |")
  for name in ("full", "quick"):
    print(f"{name}: mean |error| {statistics.mean(abs(v[name] / v['measured'] - 1) for v in out.values()):.1%}")
  return out


if __name__ == "__main__":
  main()
