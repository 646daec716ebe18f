"""XLA's persistent compilation cache, and a count of what it served.

Every generation compiles a prefill program and a decode loop (13-22 s for
SmolLM2 on a 2-core CPU). With the cache on, a second run of the same command
loads them from disk instead. The launchers turn it on (`enable`); a library
user opts in the same way. `$HITREE_COMPILE_CACHE` names the folder, or `off`.

XLA reports each lookup as a `jax.monitoring` event; `CacheEvents` counts them
so a caller can tell a real compilation from a load (decoding.Compiled does).
"""

from __future__ import annotations

import os
import pathlib

import jax
from jax import monitoring

from hitree_jax.data import assets_dir

ENV = "HITREE_COMPILE_CACHE"
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def default_dir() -> pathlib.Path | None:
  """`$HITREE_COMPILE_CACHE` (None when it says `off`), else `<assets>/xla_cache`."""
  env = os.environ.get(ENV)
  if env is not None and env.strip().lower() in ("off", "0", "none", ""):
    return None
  return pathlib.Path(env).expanduser() if env else assets_dir() / "xla_cache"


def enable(directory: str | pathlib.Path | None = None) -> pathlib.Path | None:
  """Turns the persistent cache on (every program, however quick to compile); returns its folder."""
  directory = pathlib.Path(directory) if directory is not None else default_dir()
  if directory is None:
    return None
  directory.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory


class CacheEvents:
  """Running totals of persistent-cache hits and misses in this process."""

  def __init__(self):
    self.hits = 0
    self.misses = 0
    monitoring.register_event_listener(self._on_event)

  def _on_event(self, event: str, **unused) -> None:
    del unused
    if event == _HIT:
      self.hits += 1
    elif event == _MISS:
      self.misses += 1


EVENTS = CacheEvents()
