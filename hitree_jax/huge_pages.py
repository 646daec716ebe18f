"""Weights and caches in 2 MB pages on Linux: a CPU decode step reads them faster.

A decode step streams every weight and the whole KV cache from memory
(SmolLM2 at 2K tokens: 633 MB a token). In 4 KB pages that touches some
160,000 pages, each a TLB entry to walk, and a CPU's prefetchers stop at
every page's edge; in 2 MB pages it is about 300. Measured on a 2-core AMD
EPYC, `ar` at 2048 tokens decoded 2-5% faster in 2 MB pages than in 4 KB
ones (docs/design.md).

Linux backs anonymous memory with transparent huge pages only where it is
asked to (the kernel's usual THP mode, `madvise`), and jaxlib's CPU buffers
come from glibc's malloc, which asks when $GLIBC_TUNABLES holds
`glibc.malloc.hugetlb=1`. glibc reads that once, when the process starts, so a
launcher re-executes itself once with it set (`reexec_if_needed`: from
launch/__init__.py before its imports, or launch.common.run). In a notebook or a
program of your own, start Python with it set. `HITREE_HUGE_PAGES=0` turns the
re-execution off.
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys
from typing import Mapping

from hitree_jax import errors

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "HITREE_HUGE_PAGES"
THP_ENABLED = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: pathlib.Path = THP_ENABLED) -> str | None:
  """The kernel's transparent huge page mode (always, madvise or never); None where there is none."""
  try:
    text = path.read_text()
  except OSError:
    return None
  chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
  return chosen[0] if chosen else None


def has_tunable(environ: Mapping[str, str]) -> bool:
  return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def should_reexec(environ: Mapping[str, str], mode: str | None, libc: str) -> bool:
  """Whether a process started with `environ` would get huge pages only by restarting with the
  tunable: glibc's malloc, THP in `madvise` mode, the tunable not set, and no opt-out."""
  return (libc == "glibc" and mode == "madvise" and not has_tunable(environ)
          and errors.env_switch(OPT_OUT, default=True, environ=environ))


def environ_with_tunable(environ: Mapping[str, str]) -> dict[str, str]:
  """A copy of `environ` whose GLIBC_TUNABLES also holds TUNABLE (its other tunables kept)."""
  tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
  return {**environ, "GLIBC_TUNABLES": ":".join(tunables + [TUNABLE])}


def describe(environ: Mapping[str, str] = os.environ, mode: str | None = None) -> str:
  """What this process's large buffers are backed by, in words (for benchmark records)."""
  mode = thp_mode() if mode is None else mode
  if mode == "always":
    return "2 MB pages (the kernel's THP mode is always)"
  if mode == "madvise" and has_tunable(environ):
    return f"2 MB pages (THP madvise, {TUNABLE})"
  if mode == "madvise":
    return f"4 KB pages (THP madvise without {TUNABLE})"
  return f"4 KB pages (THP {mode or 'not available'})"


def launcher_environ(environ: Mapping[str, str]) -> Mapping[str, str]:
  """The environment a launcher started with `environ` runs its work in: with the tunable when
  it restarts for it (should_reexec on this machine), else `environ` itself."""
  if should_reexec(environ, thp_mode(), platform.libc_ver()[0]):
    return environ_with_tunable(environ)
  return environ


def reexec_if_needed() -> None:
  """Replaces this process by the same command with the tunable set, when that gives it huge
  pages (should_reexec); otherwise returns. Call it first thing, before any work."""
  environ = launcher_environ(os.environ)
  if environ is not os.environ:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)
