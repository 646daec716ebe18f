"""Is `ar` read from a profile's continuations (auto.ar_from) the `ar` that profile.ar_seconds times?
Three rounds in one process, SmolLM2-135M at 512 tokens of Austen, greedy: the three 64-token
continuations (all but the first), two 96-token generations (the faster), and three 128-token ones.

  python docs/results/planner/ar_from_continuations.py
"""
from hitree_jax.loading import load_model
from hitree_jax.tokenizer import load_tokenizer
from hitree_jax.decode import engine
from hitree_jax.planner import auto, profile as pl
t = load_model("smollm2")
prompts = auto.measured_prompts(load_tokenizer(t.path), "austen", 512)
for rep in range(3):
  runs = [engine.generate(t.params, t.config, [p], max_new_tokens=64, stop_at_eos=False, seed=i) for i, p in enumerate(prompts)]
  a = auto.ar_from(runs)
  b = pl.ar_seconds(t, prompts[0], 96)
  runs128 = [engine.generate(t.params, t.config, [p], max_new_tokens=128, stop_at_eos=False) for p in prompts]
  c = auto.ar_from(runs128)
  print(f"continuations(64) {a*1e3:.2f} ms  ar_seconds(96, max of 2) {b*1e3:.2f} ms  continuations(128) {c*1e3:.2f} ms", flush=True)
