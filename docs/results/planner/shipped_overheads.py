"""Fits a round's overheads for the shipped target and drafts, greedy and at T 0.6 / top-p 0.9, at
512 tokens of Austen and batch 1, and writes them to drafts/overheads.json: what a first profile
of those models takes on a machine that has kept none (auto.shipped_overheads), instead of the
six compiled generations of the fit (84 of a first profile's 183 s here).

  python docs/results/planner/shipped_overheads.py

Run it again when a shipped draft is retrained (the fits are keyed by the models' contents;
tests/test_planner.py checks that every shipped pair has its fits).
"""

import json

from hitree_jax import huge_pages, provenance, shipped
from hitree_jax.cache.kinds import Retrieval, Streaming
from hitree_jax.decode import spec
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.planner import auto
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tokenizer import load_tokenizer

TARGET, DRAFTS, CONTEXT, BUDGET = "smollm2", ("smollm2-draft", "smollm2-draft-chat"), 512, 256


def main():
  huge_pages.reexec_if_needed()   # as launch.plan and --method=auto run
  target = load_model(TARGET)
  prompt = auto.measured_prompts(load_tokenizer(target.path), "austen", CONTEXT)[0]
  model = spec.Level.of(spec.DraftModel())
  levels = [auto.TARGET, spec.Level.of(Retrieval(BUDGET)), model, spec.Level.of(spec.DraftModel(), Streaming(16, 234))]
  fits = []
  for name in DRAFTS:
    draft = load_model(name)
    costs = profile_lib.level_costs(target, draft, levels, prompt, auto.Space().widths)
    for sampling in (SamplingParams.create(), SamplingParams.create(0.6, 0.9)):
      overheads = profile_lib.round_overheads(target, draft, prompt, sampling, budget=BUDGET, costs=costs)
      _, key = auto.where_kept(TARGET, name, CONTEXT, sampling)
      fits.append({"models": [TARGET, name], "key": auto.shipped_key(key), "context": CONTEXT, "text": "austen",
                   "overheads": overheads, "measured": provenance.stamp()})
      print(name, key["sampling"], {k: round(v * 1e3, 3) for k, v in overheads.items()}, "ms", flush=True)
  out = shipped.ROOT / "drafts" / auto.SHIPPED_OVERHEADS
  out.write_text(json.dumps({"about": __doc__.split("\n\n")[0], "fits": fits}, indent=1) + "\n")
  print("wrote", out)


if __name__ == "__main__":
  main()
