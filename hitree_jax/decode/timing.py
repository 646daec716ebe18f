"""Each level's round timed alone, on the state after prefill (generate(time_levels=True)):
what a round of the drafter, of each middle level and of the target costs, for the report."""

from __future__ import annotations

import time

import jax
import numpy as np

from hitree_jax.decode import programs as programs_lib
from hitree_jax.decode.loop import level_round


def time_levels(programs: programs_lib.Programs, ready, repeats: int = 5) -> list[float]:
  """Seconds of one round of each level (index 0: the drafter's proposal), run alone on the
  state after prefill, the median of `repeats` runs."""
  sizes = ready.sizes
  below = None
  times = []
  for j in range(sizes.top + 1):
    inputs = (ready.weights, ready.long_caches, ready.start, below if j == 1 else None)
    program = programs.get(("level", sizes, j, ready.max_new_tokens, programs_lib.shape_key(inputs)),
                           level_round, sizes, inputs[0], inputs[1], inputs[2], ready.max_new_tokens, j,
                           inputs[3])
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
      start = time.perf_counter()
      out = jax.block_until_ready(program(*inputs))
      runs.append(time.perf_counter() - start)
    if j == 0:
      below = out
    times.append(float(np.median(runs[1:])))
  return times
