"""What a measurement ran on, for its record: the CPU's name, the jax version, the commit and
the command that made it.

A speed ratio holds within one run on one machine, and the CPU model varies between machines
of the same kind, so every record names all four.
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys

from hitree_jax import shipped


def cpu_name() -> str:
  """The CPU's model name (Linux /proc/cpuinfo), else what the platform says."""
  try:
    with open("/proc/cpuinfo") as info:
      for line in info:
        if line.startswith("model name"):
          return line.partition(":")[2].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def commit() -> str | None:
  """The commit of the repository the library runs from (with "+changes" when its files differ
  from it), or None outside a git checkout (an installed wheel)."""
  git = lambda *args: subprocess.run(["git", "-C", str(shipped.ROOT), *args], capture_output=True, text=True)
  try:
    head = git("rev-parse", "--short", "HEAD")
  except OSError:
    return None
  if head.returncode:
    return None
  changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  return head.stdout.strip() + ("+changes" if changed else "")


def stamp() -> dict:
  """{cpu, jax, jaxlib, commit, command} for a record."""
  import jax
  import jaxlib
  return {"cpu": cpu_name(), "jax": jax.__version__, "jaxlib": jaxlib.__version__, "commit": commit(),
          "command": command()}


def libtpu_version() -> str | None:
  """The installed TPU compiler's version (a record compiled for a TPU slice names it), or None."""
  import importlib.metadata
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def command() -> str | None:
  """The command line that ran this process, as `python -m MODULE ARGS` for a launcher (None for
  `python -c`, whose caller knows its command)."""
  if sys.argv[:1] == ["-c"]:
    return None
  main = sys.modules.get("__main__")
  module = getattr(getattr(main, "__spec__", None), "name", None)
  head = f"python -m {module}" if module else shlex.quote(sys.argv[0])
  return " ".join([head, *map(shlex.quote, sys.argv[1:])])
