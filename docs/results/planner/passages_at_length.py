"""How many passages must a profile at a long context take acceptance over? At 7,680 tokens each
passage costs a first plan a 15 s prefill and its 128-token continuation (19 s here), a third of
the first plan's time. For SmolLM2-135M + drafts/smollm2-draft.gguf on Austen, greedy, at CONTEXT
tokens: each passage of book_prompts' two-passage and three-passage sets, its acceptance taken as
a profile takes it; the level costs timed once; and what the planner predicts and chooses from
each set's mean acceptance and from each passage alone.

  python docs/results/planner/passages_at_length.py 7680 [MEASURED.json]

The last line printed is the record as JSON; MEASURED.json: a record of this script's, whose
acceptance and costs are read instead of measured again.
"""

import json
import sys

from hitree_jax import provenance
from hitree_jax.data import book_prompts
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.planner import auto
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tokenizer import load_tokenizer

DRAFT = "drafts/smollm2-draft.gguf"
# Stacks whose predictions are compared (besides each set's choice).
STACKS = ("ngram:3/chain:2", "ngram:3/chain:4", "ngram:3/chain:6", "draft/chain:4", "retrieval:256/chain:6")


def main():
  context = int(sys.argv[1])
  measured = json.load(open(sys.argv[2]))["measured"] if len(sys.argv) > 2 else measure(context)
  acceptance, costs = measured["acceptance"], measured["costs"]
  profiles = {"3 passages": ["3:0", "3:1", "3:2"], "2 passages": ["2:0", "2:1"],
              **{f"passage {name}": [name] for name in acceptance}}
  out = {}
  for label, names in profiles.items():
    profile = {"context": context, "passages": len(names), "continuations": len(names),
               "acceptance": auto._mean([acceptance[name] for name in names]), **costs}
    choice = auto.choose(profile, greedy=True)
    ar = profile["ar_seconds"]
    out[label] = {"chose": str(choice.levels) if choice.levels else "ar",
                  "chose_x_ar": choice.predicted_tokens_per_s * ar,
                  **{stack: {"x_ar": ar / (p := auto.predict(profile, True, stack)).seconds_per_token,
                             "tokens_per_forward": p.tokens_per_target_forward} for stack in STACKS}}
    print(label, out[label]["chose"], f"{out[label]['chose_x_ar']:.3f}x",
          " ".join(f"{s}={out[label][s]['x_ar']:.3f}x" for s in STACKS), flush=True)
  print(json.dumps({**provenance.stamp(), "context": context, "draft": DRAFT, "predictions": out,
                    "measured": {"acceptance": acceptance, "costs": costs}}))


def measure(context: int) -> dict:
  """{"acceptance": {"SET:I": passage I of the SET-passage set's}, "costs": the costs, overheads
  and `ar`}."""
  greedy = SamplingParams.create()
  target, draft = load_model("smollm2"), load_model(DRAFT)
  tokenizer = load_tokenizer(target.path)
  sets = {n: book_prompts(tokenizer, context, n) for n in (2, 3)}
  space = auto.Space().measured(context)
  acceptance, caches, runs = {}, {}, []
  for n, prompts in sets.items():
    for i, prompt in enumerate(prompts):
      run = engine.generate(target.params, target.config, [prompt], sampling=greedy, max_new_tokens=auto.CONTINUATION,
                            stop_at_eos=False, keep_long_caches=True)
      runs.append(run)
      caches[n, i] = run.long_caches[0]
      acceptance[f"{n}:{i}"] = profile_lib.pair_acceptance(target, draft, space.pairs(), prompt, run.tokens[0],
                                                           greedy, None, space.chains, run.long_caches[0])
  key = auto.profile_key(target.path, DRAFT, context, greedy, "austen")
  costs = auto.measure_costs(target, draft, sets[3][0], greedy, space, overheads=auto.shipped_overheads(key),
                             ar_seconds=auto.ar_from(runs), target_cache=caches[3, 0])
  measured = {"acceptance": acceptance, "costs": costs}
  print("measured", json.dumps(measured), flush=True)
  return measured


if __name__ == "__main__":
  main()
