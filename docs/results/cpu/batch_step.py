"""`ar`'s decoding step at a batch of B copies of one Austen passage of CONTEXT tokens: SmolLM2-135M,
greedy, 32 new tokens, ms per step (the second of two runs at 4,096 and below, the only one above).
Run it plainly (4 KB pages) and under GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (2 MB pages, as the
launchers restart themselves); the record names which.

  python docs/results/cpu/batch_step.py 4096 1,2,4,8 > docs/results/cpu/batch_step_4096.json
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python docs/results/cpu/batch_step.py 7680 4,6,8 > OUT.json
"""

import json
import sys

from hitree_jax import huge_pages, provenance
from hitree_jax.decode import engine
from hitree_jax.loading import load_model
from hitree_jax.planner import auto
from hitree_jax.tokenizer import load_tokenizer


def main():
  context, batches = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
  target = load_model("smollm2")
  prompt = auto.measured_prompts(load_tokenizer(target.path), "austen", context)[0]
  out = {}
  for rows in batches:
    for _ in range(1 if context > 4096 else 2):
      r = engine.generate(target.params, target.config, [prompt] * rows, max_new_tokens=32, stop_at_eos=False)
    out[rows] = 1e3 * r.decode_s / 31
    print(f"{context} tokens, {rows} rows: {out[rows]:.1f} ms a step, {out[rows] / rows:.1f} a row", file=sys.stderr)
  print(json.dumps({**provenance.stamp(), "context": context, "memory_pages": huge_pages.describe(),
                    "ms_per_step": out}))


if __name__ == "__main__":
  main()
