"""The planner for a chip you do not have: each level's cost from the compiler's roofline
(roofline.py), acceptance from a file, and the same model and search as a measured profile.

An acceptance file is JSON:

  {"source": "where the figures come from (a paper, a measurement and its command)",
   "acceptance": {"target<-retrieval:4096": 0.9,
                  "retrieval:4096<-draft@streaming:16x234": {"alpha": 0.5, "greedy": 0.55}}}

Pairs are "verifier<-proposer" in profile.py's level names. A number is a chain's per-token
acceptance, greedy and sampled alike; a record may give them apart ("greedy", "alpha") and
per-rank profiles ("greedy_profile", "profile", for trees). A profile measured here
(launch.plan keeps them under assets/profiles) is an acceptance file too: its "acceptance" is
read and its "source" is its key.

A prediction from it is a roofline's: the levels' forwards at the chip's stated bandwidth and
peak, no per-round overheads (a round's sampling and bookkeeping on an accelerator are not
modelled), and the acceptance as stated.
"""

from __future__ import annotations

import json
import pathlib
import re

from hitree_jax.decode import spec
from hitree_jax.errors import UsageError
from hitree_jax.planner import auto

PAIR = re.compile(r"^[\w:@.+x-]+<-[\w:@.+x-]+$")


def load_acceptance(path: str | pathlib.Path) -> dict:
  """{"source": str, "acceptance": {pair: profile-style record}} from an acceptance file, each
  record with greedy, alpha, greedy_profile and profile. Raises ValueError naming what is wrong."""
  path = pathlib.Path(path)
  data = read_json("acceptance", path)
  pairs = data.get("acceptance") if isinstance(data, dict) else None
  if not isinstance(pairs, dict) or not pairs:
    raise UsageError(f"--acceptance={path}: expected an object with \"acceptance\": {{\"verifier<-proposer\": a}}")
  source = data.get("source") or (json.dumps(data["key"]) if "key" in data else None)
  if not source:
    raise UsageError(f"--acceptance={path}: say where the figures come from in \"source\"")
  return {"source": source, "acceptance": {pair: _record(path, pair, value) for pair, value in pairs.items()}}


def read_json(flag: str, path: pathlib.Path):
  """The JSON a file named by --FLAG holds; a missing file or bad JSON is one line naming both."""
  if not path.is_file():
    raise UsageError(f"--{flag}={path}: no such file")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise UsageError(f"--{flag}={path}: not JSON ({error})") from None


def load_acceptance_length(path: str | pathlib.Path) -> dict:
  """{"source": str, "stack": str, "acceptance_length": {benchmark: tau}} from a file of published
  mean tokens per round (launch.level_cost --acceptance_length), checked: a source, and each tau a
  number of at least 1 (a round commits at least one token). "stack" (optional) is the --levels
  stack the taus were measured with; the stack they are applied to must be it."""
  path = pathlib.Path(path)
  data = read_json("acceptance_length", path)
  taus = data.get("acceptance_length") if isinstance(data, dict) else None
  if not isinstance(taus, dict) or not taus:
    raise UsageError(f"--acceptance_length={path}: expected \"acceptance_length\": {{benchmark: tau}}")
  if not data.get("source"):
    raise UsageError(f"--acceptance_length={path}: say where the figures come from in \"source\"")
  for name, tau in taus.items():
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau < 1:
      raise UsageError(f"--acceptance_length={path}: {name}: {tau!r} is not a mean of tokens per round (>= 1)")
  return data


def _record(path, pair: str, value) -> dict:
  if not PAIR.match(pair):
    raise UsageError(f"--acceptance={path}: {pair!r} is not a pair \"verifier<-proposer\"")
  if isinstance(value, (int, float)):
    value = {"greedy": value, "alpha": value}
  if not isinstance(value, dict) or not ({"greedy", "alpha"} & value.keys()):
    raise UsageError(f"--acceptance={path}: {pair}: give a number, or \"greedy\" and/or \"alpha\"")
  greedy, alpha = value.get("greedy", value.get("alpha")), value.get("alpha", value.get("greedy"))
  record = {"greedy": greedy, "alpha": alpha,
            "greedy_profile": value.get("greedy_profile", [greedy]), "profile": value.get("profile", [alpha])}
  for name in ("greedy", "alpha"):
    if not 0 <= record[name] <= 1:
      raise UsageError(f"--acceptance={path}: {pair}: {name} {record[name]} is not in [0, 1]")
  return record


def levels_of(acceptance: dict) -> list[str]:
  """The level names an acceptance file's pairs mention, the target included."""
  names = {name for pair in acceptance for name in pair.split("<-")}
  return sorted(names | {auto.TARGET})


def space_for(acceptance: dict, chains=(1, 2, 3, 4, 6, 8), gammas=(2, 3, 4, 6, 8, 12)) -> auto.Space:
  """The planner's space over the levels an acceptance file names: each proposer drafts; each
  level that both proposes and verifies is a middle level (cheapest first: the caller orders
  costs); trees only where a per-rank profile of more than one rank is given."""
  verifiers = {pair.split("<-")[0] for pair in acceptance}
  proposers = {pair.split("<-")[1] for pair in acceptance}
  ranked = any(len(r["greedy_profile"]) > 1 for r in acceptance.values())
  middles = tuple(sorted((verifiers & proposers) - {auto.TARGET}, key=_cheapness))
  return auto.Space(drafters=tuple(sorted(proposers, key=_cheapness)), middles=middles, chains=chains,
                    trees=auto.Space.trees if ranked else (), gammas=gammas)


def _cheapness(name: str) -> tuple:
  """Drafts and streaming caches before retrieval levels, smaller budgets first."""
  budget = spec.parse_level(name).budget
  return (budget is not None, budget or 0, name)


def profile(costs: dict[str, dict[int, float]], acceptance: dict, context: int) -> dict:
  """A planner profile: costs {level: {width: seconds}} (the roofline's, the target's included),
  the file's acceptance, no overheads, and `ar` as the target's one-token forward."""
  return {"context": context, "costs": costs, "acceptance": acceptance,
          "overheads": {"draft_forward": 0.0, "verify": 0.0, "tree": 0.0},
          "ar_seconds": costs["target"][1]}
