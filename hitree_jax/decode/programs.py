"""Compiled programs, memoised by shape, with the time spent compiling.

Programs are compiled ahead of time (`jit(...).lower(...).compile()`), so
compile time is measured apart from run time, and a second generation of the
same shape bucket compiles nothing. Whoever generates owns a `Programs`
(a launcher keeps one per process; a test makes its own to start cold).
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import numpy as np

from hitree_jax import compile_cache


# XLA:CPU's copy insertion, without region analysis, copied every layer's cache in each prefill
# chunk (a program that reads the cache in a loop of blocks, then writes the chunk into it): twice
# the cache's memory, and 8% of a 6K prompt's prefill time. With it, nothing is copied. Decoding
# programs measured no better with it (51 vs 53 tok/s at 2K, 42 vs 40 at 6K): they keep the default.
CPU_COPY_FREE = {"xla_cpu_copy_insertion_use_region_analysis": True}


# LLVM's preferred vector width, which XLA:CPU sets to 256 bits by default (wide vectors slowed
# the clock of older Intel parts). On an AVX-512 CPU 512 bits decode 4-11% faster (ar, SmolLM2,
# 512-7.5K prompt tokens) with the same tokens; a CPU without AVX-512 keeps its own widest.
# A width named in $XLA_FLAGS wins.
CPU_DEFAULTS = {"xla_cpu_prefer_vector_width": 512}


def cpu_options(extra: dict | None = None) -> dict:
  """The XLA debug options every CPU program is compiled with: CPU_DEFAULTS (less any option
  $XLA_FLAGS sets), then `extra`."""
  flags = os.environ.get("XLA_FLAGS", "")
  return {**{k: v for k, v in CPU_DEFAULTS.items() if k not in flags}, **(extra or {})}


def compile_lowered(lowered, extra_cpu_options: dict | None = None):
  """lowered.compile(), with cpu_options(extra_cpu_options) when the program is for the CPU."""
  return lowered.compile(cpu_options(extra_cpu_options) if jax.default_backend() == "cpu" else None)


def ahead_of_time(jitted):
  """`jitted` compiled per input shapes as the engine compiles its programs (a Programs memo of
  its own, keyed by shape_key), for isolated timings, so they time the programs the engine runs.
  Positional array arguments only; `.lower` is jitted's."""
  programs = Programs()

  def call(*args):
    return programs.get(shape_key(args), jitted, *args)(*args)

  call.lower = jitted.lower
  call.compiling = lambda *args: (programs, shape_key(args), jitted, args)   # for compile_together
  return call


# Threads compiling beside the caller's lowering in compile_together.
COMPILE_THREADS = 2


def compile_together(compilings) -> None:
  """Compiles ahead_of_time programs before any of them runs, each lowered here while XLA
  compiles the ones before on other threads: lowering traces Python and holds the GIL, XLA's
  compile lets it go. A profile's timed forwards, six programs of SmolLM2 at 512 tokens: 13.8 s
  one after the other, 10.7 s together (2-core AMD EPYC). compilings: [call.compiling(*args)].
  Timings must wait for it: compiling takes the cores a timed program would run on."""
  todo = {}
  for programs, key, jitted, args in compilings:
    if key not in programs._programs:
      todo[id(programs), key] = programs, key, jitted, args
  if not todo:
    return
  start = time.perf_counter()
  hits = compile_cache.EVENTS.hits
  with concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS) as pool:
    futures = [(programs, key, pool.submit(compile_lowered, jitted.lower(*args)))
               for programs, key, jitted, args in todo.values()]
    for programs, key, future in futures:
      programs._programs[key] = future.result()
  share = (time.perf_counter() - start) / len(futures)
  loads = min(compile_cache.EVENTS.hits - hits, len(futures))   # served by the persistent cache
  for i, (programs, _, _) in enumerate(futures):
    programs.compile_s += share
    if i < loads:
      programs.cache_loads += 1
    else:
      programs.compiles += 1


def shape_key(tree) -> tuple:
  """A hashable key of a pytree's array shapes, dtypes and (device arrays') shardings; other
  leaves as they are. A program is compiled for its inputs' shardings as much as their shapes."""
  def key(x):
    if isinstance(x, jax.Array):
      return x.shape, str(x.dtype), x.sharding
    if isinstance(x, (np.ndarray, np.generic)):
      return x.shape, str(x.dtype)
    return x
  return tuple(map(key, jax.tree.leaves(tree)))


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

  def get(self, key, jitted, *example_args, extra_cpu_options: dict | None = None):
    """The program for `key`, compiled from jitted.lower(*example_args) the first time (with
    cpu_options(extra_cpu_options) on the CPU: compile_lowered)."""
    if key not in self._programs:
      start = time.perf_counter()
      hits, misses = compile_cache.EVENTS.hits, compile_cache.EVENTS.misses
      self._programs[key] = compile_lowered(jitted.lower(*example_args), extra_cpu_options)
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
