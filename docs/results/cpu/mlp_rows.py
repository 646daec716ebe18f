"""SmolLM2's 30 MLP blocks alone (random float32 weights, 318 MB), jitted by XLA:CPU, for 1 to 17
rows, and the same products in numpy (OpenBLAS) for 1 and 9: what a verification's wide forward
costs in its largest part, on this CPU, against `ar`'s 1-row step.

  JAX_PLATFORMS=cpu python docs/results/cpu/mlp_rows.py > docs/results/cpu/mlp_rows.txt
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

EMBED, MLP, LAYERS, REPEATS = 576, 1536, 30, 15


def mlp_blocks(x, weights, silu=jax.nn.silu):
  """x [M, E] through LAYERS gated MLPs (gate, up [E, F]; down stored [E, F] and transposed)."""
  for i in range(LAYERS):
    gate, up, down = weights[3 * i:3 * i + 3]
    x = x + (silu(x @ gate) * (x @ up)) @ down.T
  return x


def median_ms(call) -> float:
  times = []
  for _ in range(REPEATS):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main():
  rng = np.random.default_rng(0)
  weights = [(rng.standard_normal((EMBED, MLP), np.float32) * 0.02) for _ in range(3 * LAYERS)]
  on_device = [jnp.asarray(w) for w in weights]
  jitted = jax.jit(mlp_blocks)
  for rows in (1, 3, 5, 9, 17):
    x = jnp.ones((rows, EMBED), jnp.float32)
    jitted(x, on_device).block_until_ready()
    print(f"XLA:CPU, {rows} rows: {median_ms(lambda: jitted(x, on_device).block_until_ready()):.2f} ms")
  silu = lambda g: g / (1 + np.exp(-g))
  for rows in (1, 9):
    x = np.ones((rows, EMBED), np.float32)
    print(f"numpy (OpenBLAS), {rows} rows: {median_ms(lambda: mlp_blocks(x, weights, silu)):.2f} ms")


if __name__ == "__main__":
  main()
