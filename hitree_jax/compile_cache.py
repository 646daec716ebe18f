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
from typing import Mapping

import jax
from jax import monitoring

from hitree_jax import errors
from hitree_jax.data import assets_dir

ENV = "HITREE_COMPILE_CACHE"
ON = ("1", "true", "yes", "on")   # a switch said on: the default folder, not one named "true"
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def default_dir(environ: Mapping[str, str] = os.environ) -> pathlib.Path | None:
  """`$HITREE_COMPILE_CACHE`: a folder; off as every switch is (errors.env_switch: 0, false, no,
  off, empty; and none), giving None; on (1, true, yes...) or unset: `<assets>/xla_cache`."""
  env = environ.get(ENV)
  if env is None:
    return assets_dir() / "xla_cache"
  if env.strip().lower() == "none" or not errors.env_switch(ENV, True, environ):
    return None
  if env.strip().lower() in ON:
    return assets_dir() / "xla_cache"
  return pathlib.Path(env).expanduser()


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
