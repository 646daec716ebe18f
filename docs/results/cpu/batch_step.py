"""`ar`'s decoding step at a batch of B copies of one Austen passage of CONTEXT tokens: SmolLM2-135M,
greedy, 32 new tokens, ms per step (the second of two runs at 4,096 and below, the only one above).

  python docs/results/cpu/batch_step.py 4096
"""

import sys
from hitree_jax.loading import load_model
from hitree_jax.decode import engine
from hitree_jax.planner import auto
from hitree_jax.tokenizer import load_tokenizer
ctx = int(sys.argv[1])
t = load_model("smollm2")
p = auto.measured_prompts(load_tokenizer(t.path), "austen", ctx)[0]
for rows in ((1, 2, 4, 8) if ctx <= 4096 else (1, 4, 8)):
  for rep in range(1 if ctx > 4096 else 2):
    r = engine.generate(t.params, t.config, [p] * rows, max_new_tokens=32, stop_at_eos=False)
  print(ctx, "rows", rows, "ms per step", round(1e3 * r.decode_s / 31, 1), flush=True)
