"""Experiment: every level's timed forwards scaled by `ar`'s measured step over the target's one-token
forward timed alone, before the overheads are fitted; a fresh profile at 512 tokens, batch 1,
greedy (in a temporary directory), and its predictions against `ar`.

  python docs/results/planner/calibrated_profile.py
"""
import tempfile
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.planner import auto, profile as pl

def calibrated(target, draft, prompt, sampling, space=auto.Space(), repeats=10, eagle=None, rows=1):
  space = space.measured(len(prompt), eagle)
  costs = pl.level_costs(target, draft, space.model_levels(), prompt, space.widths, repeats, eagle, rows)
  ar = pl.ar_seconds(target, prompt, 96, rows)
  factor = ar / costs["target"][1]
  print("factor", factor, flush=True)
  costs = {k: {w: s * factor for w, s in v.items()} for k, v in costs.items()}
  over = pl.round_overheads(target, draft, prompt, sampling, budget=256, costs=costs, rows=rows)
  return {"costs": costs, "overheads": over, "ar_seconds": ar, "factor": factor}

auto.measure_costs = calibrated
greedy = SamplingParams.create()
choice, profile, path = auto.plan_for("smollm2", "drafts/smollm2-draft.gguf", 512, greedy, tempfile.mkdtemp())
print("overheads", profile["overheads"], "ar tok/s", 1 / profile["ar_seconds"])
print("chosen", choice.levels, choice.predicted_tokens_per_s / choice.ar_tokens_per_s)
for s in ("ngram:3/chain:2", "ngram:3/chain:3", "draft/chain:2"):
  print(s, round(1 / auto.predict(profile, True, s).seconds_per_token * profile["ar_seconds"], 3))
print("measured (ngram_overheads_512): 1.29, 1.38, 1.03 x ar")
