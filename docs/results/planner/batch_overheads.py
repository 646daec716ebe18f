"""A round's overheads fitted at a batch of ROWS copies of a 512-token Austen passage, equation by
equation: for each of profile.round_overheads' six reference stacks, its counts (model drafter
forwards, verifying rounds, rounds verifying a tree, rounds of a middle level) and the decode
seconds its forwards leave (`rest`), then the fit. SmolLM2-135M + drafts/smollm2-draft.gguf,
greedy; the forwards' costs are those of the stored profile at that batch (measured first where
there is none, in DIRECTORY or the default profile folder).

  python docs/results/planner/batch_overheads.py 16 [DIRECTORY]
"""

import sys

from hitree_jax import huge_pages
from hitree_jax.decode import engine
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.loading import load_model
from hitree_jax.planner import auto
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tokenizer import load_tokenizer

DRAFT = "drafts/smollm2-draft.gguf"


def main():
  huge_pages.reexec_if_needed()
  rows = int(sys.argv[1])
  directory = sys.argv[2] if len(sys.argv) > 2 else None
  greedy = SamplingParams.create()
  profile, path = auto.profiled("smollm2", DRAFT, 512, greedy, directory, batch=rows)
  print(f"forwards' costs from {path}; the stacks, in order: draft/chain:1, draft/chain:4, draft/kary:2x2, "
        "draft@streaming:16x234/chain:1+retrieval:256/6, ngram:3/chain:2+draft/3, ngram:3/chain:4 (each run twice)")
  target, draft = load_model("smollm2"), load_model(DRAFT)
  prompt = auto.measured_prompts(load_tokenizer(target.path), "austen", 512)[0]
  fit, generate = profile_lib.nonnegative_least_squares, engine.generate

  def shown(a, b):
    for row, rest in zip(a, b):
      rounds = row[1]
      print(f"  counts {[int(x) for x in row]}  rest {rest:.4f} s ({rest / rounds * 1e3:.1f} ms a verifying round)")
    return fit(a, b)

  def logged(*args, **kwargs):
    run = generate(*args, **kwargs)
    if kwargs.get("stack") is not None and run.levels:
      print(f"  a generation: levels' (forwards, proposed) {[(lv['forwards'], lv['proposed']) for lv in run.levels]}, "
            f"decode {run.decode_s:.3f} s")
    return run

  profile_lib.nonnegative_least_squares, engine.generate = shown, logged
  overheads = profile_lib.round_overheads(target, draft, prompt, greedy, budget=256,
                                          max_new_tokens=max(auto.GENERATED // rows, 32), costs=profile["costs"],
                                          rows=rows)
  print("fit:", {k: f"{v * 1e3:.2f} ms" for k, v in overheads.items()})


if __name__ == "__main__":
  main()
