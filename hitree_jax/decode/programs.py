"""Compiled programs, memoised by shape, with the time spent compiling.

Programs are compiled ahead of time (`jit(...).lower(...).compile()`), so
compile time is measured apart from run time, and a second generation of the
same shape bucket compiles nothing. Whoever generates owns a `Programs`
(a launcher keeps one per process; a test makes its own to start cold).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from hitree_jax import compile_cache


def shape_key(tree) -> tuple:
  """A hashable key of a pytree's array shapes and dtypes (other leaves as they are)."""
  return tuple((x.shape, str(x.dtype)) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x
               for x in jax.tree.leaves(tree))


class Programs:
  """A memo of AOT-compiled programs.

  compiles counts programs XLA really compiled; cache_loads those the
  persistent compilation cache (compile_cache.enable) served from disk.
  """

  def __init__(self):
    self._programs = {}
    self.compile_s = 0.0
    self.compiles = 0
    self.cache_loads = 0

  def get(self, key, jitted, *example_args):
    """The program for `key`, compiled from jitted.lower(*example_args) the first time."""
    if key not in self._programs:
      start = time.perf_counter()
      hits, misses = compile_cache.EVENTS.hits, compile_cache.EVENTS.misses
      self._programs[key] = jitted.lower(*example_args).compile()
      self.compile_s += time.perf_counter() - start
      if compile_cache.EVENTS.hits > hits and compile_cache.EVENTS.misses == misses:
        self.cache_loads += 1
      else:
        self.compiles += 1
    return self._programs[key]

  def clear(self) -> None:
    """Drops the compiled programs (their machine code is freed once nothing else holds them)."""
    self._programs.clear()

  def counts(self) -> tuple[float, int, int]:
    """(compile_s, compiles, cache_loads) so far."""
    return self.compile_s, self.compiles, self.cache_loads

  def since(self, before: tuple[float, int, int]) -> dict:
    """GenerationResult's compile fields for what was compiled since `before` (counts())."""
    compile_s, compiles, loads = (now - then for now, then in zip(self.counts(), before))
    return dict(compile_s=compile_s, compiles=compiles, cache_loads=loads)


_SHARED = Programs()


def shared() -> Programs:
  """The Programs of callers that pass none (library calls without an owner of their own)."""
  return _SHARED
