"""Timing a program, the one way this project does: `median_seconds` (a warm-up call, then the
median of several, each waited for), which the planner's profiles, the launchers and each
level's round timed alone on the state after prefill (generate(time_levels=True): what a round
of the drafter, of each middle level and of the target costs, for the report) all use."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax

from hitree_jax.decode import programs as programs_lib
from hitree_jax.decode.loop import level_round


def median_seconds(fn: Callable, *args, repeats: int) -> float:
  """Seconds of fn(*args), the median of `repeats` calls after one that compiles and warms up,
  each waited for (jax.block_until_ready)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


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
    times.append(median_seconds(program, *inputs, repeats=repeats))
    if j == 0:   # the drafter's proposal, which level 1's round verifies
      below = program(*inputs)
  return times
