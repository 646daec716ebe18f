"""Where a first plan's time goes: each phase of auto.profiled, its wall time and how much of it
is XLA compiling (jax.monitoring's compile events), for SmolLM2-135M + drafts/smollm2-draft.gguf,
greedy, on Austen (or TEXT, DRAFT, and --full for launch.plan --full_profile).

  python docs/results/planner/first_profile_phases.py 512             # a fresh profile directory
  python docs/results/planner/first_profile_phases.py 2048 DIRECTORY  # profiles kept in DIRECTORY
  python docs/results/planner/first_profile_phases.py 128 DIRECTORY chat smollm2-draft-chat
  python docs/results/planner/first_profile_phases.py 7680 DIRECTORY --sampled   # T 0.6, top-p 0.9

It runs with 2 MB pages where the launchers do (huge_pages.reexec_if_needed: launch.plan and
--method=auto restart themselves so); a record without `memory_pages` ran with 4 KB pages. The
last line printed is the record as JSON (the phases, the machine, jax, the commit, the command).

With a profile of the same models at another context in DIRECTORY, the round overheads are
borrowed from it, else from the fits shipped for the shipped models (auto.stored_overheads), and
round_overheads does not run.
"""

import collections
import functools
import json
import sys
import tempfile
import time

import jax

from hitree_jax import huge_pages, provenance
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.planner import auto
from hitree_jax.planner import profile as profile_lib

PHASES = ("pair_acceptances", "level_costs", "round_overheads", "ar_seconds", "generate")
phase = ["other"]
compile_s, compiles, spent = collections.Counter(), collections.Counter(), collections.Counter()


def on_event(event: str, duration: float, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    compile_s[phase[0]] += duration
    compiles[phase[0]] += 1


def timed(name: str, module=profile_lib, label: str | None = None):
  """module.NAME, its time and its compiles counted under `label` (default: its name; engine's
  generations only where the profile calls them itself: the continuations)."""
  inner, name = getattr(module, name), label or name

  @functools.wraps(inner)
  def run(*args, **kwargs):
    if module is engine and phase[0] != "other":
      return inner(*args, **kwargs)
    outer, phase[0], start = phase[0], name, time.perf_counter()
    try:
      return inner(*args, **kwargs)
    finally:
      spent[name] += time.perf_counter() - start
      phase[0] = outer
  return run


def main():
  huge_pages.reexec_if_needed()
  full, sampled = "--full" in sys.argv, "--sampled" in sys.argv
  args = [arg for arg in sys.argv[1:] if arg not in ("--full", "--sampled")]
  sampling = SamplingParams.create(temperature=0.6, top_p=0.9) if sampled else SamplingParams.create()
  context = int(args[0])
  directory = args[1] if len(args) > 1 else tempfile.mkdtemp()
  text = args[2] if len(args) > 2 else "austen"
  draft = args[3] if len(args) > 3 else "drafts/smollm2-draft.gguf"
  jax.monitoring.register_event_duration_secs_listener(on_event)
  for name in PHASES[:-1]:
    setattr(profile_lib, name, timed(name))
  engine.generate = timed("generate", engine)   # the target's continuations
  engine.generate_samples = timed("generate_samples", engine, "generate")   # sampled, from one prefill
  start = time.perf_counter()
  choice, profile, path = auto.plan_for("smollm2", draft, context, sampling, directory, text,
                                        full=full)
  total = time.perf_counter() - start
  print(f"total {total:.1f} s, chose {choice.levels}, kept in {path}")
  spent["other"] = total - sum(spent.values())
  for name in (*PHASES, "other"):
    print(f"{name}: {spent[name]:.1f} s, of which compiling {compile_s[name]:.1f} s ({compiles[name]} programs)")
  print("overheads", {k: round(v * 1e3, 2) for k, v in profile["overheads"].items()}, "ms;",
        "from", profile.get("overheads_from", "this profile's own fit"))
  print(json.dumps({**provenance.stamp(), "context": context, "text": text, "draft": draft, "full": full, "memory_pages": huge_pages.describe(),
                    "sampling": [float(sampling.temperature), float(sampling.top_p)],
                    "chose": str(choice.levels), "total_s": total,
                    "phases": {name: {"seconds": spent[name], "compile_s": compile_s[name], "compiles": compiles[name]}
                               for name in (*PHASES, "other")},
                    "overheads": profile["overheads"], "overheads_from": profile.get("overheads_from")}))


if __name__ == "__main__":
  main()
