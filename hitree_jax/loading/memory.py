"""How much host memory loading a model takes: its peak above the process's start, against the
bytes of the weights it ends with. tests/test_loading.py holds the GGUF loader to its aim with
it, and docs/results/cpu/load_memory.py measures a 1B-shape file with it.

Anonymous memory (RssAnon) is what counts: the file's pages that the loader reads through its
memory map are page cache, which the kernel drops under pressure. A thread samples it while the
load runs; each tensor lives for milliseconds, so the sampled peak is read from /proc every
millisecond.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp


def anonymous_bytes() -> int:
  """This process's resident anonymous memory (Linux /proc/self/status RssAnon), in bytes."""
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise OSError("no RssAnon in /proc/self/status (Linux only)")


def peak_while(fn, interval_s: float = 0.001) -> tuple[object, int, int]:
  """(fn(), the peak anonymous bytes while it ran, the anonymous bytes before it)."""
  jnp.zeros(1).block_until_ready()   # the backend's own start-up is not the load's
  before = peak = anonymous_bytes()
  done = threading.Event()

  def sample():
    nonlocal peak
    while not done.is_set():
      peak = max(peak, anonymous_bytes())
      time.sleep(interval_s)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  try:
    result = jax.block_until_ready(fn())
  finally:
    done.set()
    sampler.join()
  return result, max(peak, anonymous_bytes()), before


def tree_bytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
