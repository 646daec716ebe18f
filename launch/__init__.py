"""The command-line launchers: `python -m launch.NAME` in the repository, `hitree-NAME` installed.

A launcher restarts itself once so that its arrays can sit in 2 MB pages (hitree_jax/huge_pages.py).
Started as a launcher, the process restarts here, when this package is imported and before the
launcher's own imports (jax, flax, transformers), which it would otherwise load twice. common.run
restarts a launcher started any other way (runpy, a program of one's own calling its `run`).
"""

import pathlib
import sys


def started_as_a_launcher(argv: list[str]) -> bool:
  """Whether `argv` (sys.orig_argv) starts a launcher: `python [options] -m launch.NAME` (or
  hitree_jax.launch.NAME), or an installed `hitree-NAME` command."""
  args = iter(argv[1:])
  for arg in args:
    if arg.startswith("-m"):   # -m NAME or -mNAME
      module = arg[2:] or next(args, "")
      return module.startswith(("launch.", "hitree_jax.launch."))
    if arg.startswith("-c"):
      return False
    if arg in ("-X", "-W"):   # options whose value is the next word
      next(args, None)
    elif not arg.startswith("-"):   # a script: an installed command is one
      return pathlib.PurePath(arg).name.startswith("hitree-")
  return False


if started_as_a_launcher(sys.orig_argv):
  from hitree_jax import huge_pages
  huge_pages.reexec_if_needed()
