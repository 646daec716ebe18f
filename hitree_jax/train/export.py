"""Writing a trained draft so that an interruption never leaves a half-written one.

A draft is a GGUF with its sidecar (`NAME.json`: its evaluation, which `sequoia` trees read), or a
folder of heads. `replacing(out)` hands out a temporary name beside `out`; the export writes the
new draft there, evaluates it, and only when all of it is whole is it renamed into place. A
crash or Ctrl-C before then leaves the previous draft (and its sidecar) as they were, and the
temporary is removed. The GGUF and its sidecar are two renames, one right after the other; the
sidecar names its draft's contents (`draft_contents`, loading/digest.py), so a sidecar that
outlived its draft is told apart from its own (`check_sidecar`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
from typing import Iterator

from hitree_jax.errors import UsageError
from hitree_jax.loading.digest import contents_digest


def sidecar(draft: pathlib.Path) -> pathlib.Path:
  """Where a GGUF draft's evaluation is kept: beside it, NAME.json."""
  return draft.with_suffix(".json")


@contextlib.contextmanager
def replacing(out: str | pathlib.Path) -> Iterator[pathlib.Path]:
  """Yields the temporary path to write the new draft to (a GGUF file and its sidecar, or a
  folder), in `out`'s folder; on a clean exit it replaces `out` (and the sidecar), else it is
  removed and `out` is untouched."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  partial = out.with_name(f".{out.stem}.{os.getpid()}.partial{out.suffix}")
  _remove(partial)
  try:
    yield partial
  except BaseException:
    _remove(partial)
    _remove(sidecar(partial))
    raise
  if partial.is_dir():
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    if out.exists():
      os.replace(out, old)
    os.replace(partial, out)
    _remove(old)
  else:
    os.replace(partial, out)
    if sidecar(partial).exists():
      os.replace(sidecar(partial), sidecar(out))


def write_sidecar(draft: pathlib.Path, record: dict) -> pathlib.Path:
  """The draft's evaluation beside it, with its contents' digest."""
  path = sidecar(draft)
  path.write_text(json.dumps({**record, "draft_contents": contents_digest(draft)}, indent=1))
  return path


def check_sidecar(draft: str | pathlib.Path, record: dict) -> dict:
  """The sidecar's record where it describes this draft's contents (a sidecar written before
  digests were is taken as it is); else a UsageError naming both."""
  draft = pathlib.Path(draft)
  written = record.get("draft_contents")
  if written is not None and written != contents_digest(draft):
    raise UsageError(f"{sidecar(draft)} describes another version of {draft} (its contents have "
                     f"changed since): evaluate it again (python -m launch.distill --eval "
                     f"--draft={draft} --json) or give --acceptance")
  return record


def _remove(path: pathlib.Path) -> None:
  if path.is_dir():
    shutil.rmtree(path)
  elif path.exists():
    path.unlink()
