"""A model's contents in 16 hex digits: what stored results made from a model (planner profiles)
are keyed by, so that a draft retrained in place is measured again rather than planned from the
old one's figures.

Each file's size and its first and last MiB are hashed (with their names within a folder; a
single file's own name is not part of it, so a file renamed into place keeps its digest): every
weight of a retrained model differs, so its bytes there do; reading 2 MiB per file keeps the key
instant for a 16 GB model. A change confined to a file's middle that keeps its size is not seen.
"""

from __future__ import annotations

import hashlib
import pathlib

SAMPLED = 1 << 20   # bytes hashed at each end of a file


def contents_digest(path: str | pathlib.Path) -> str | None:
  """The digest of a model file's or folder's contents; None where there is no such path."""
  path = pathlib.Path(path)
  if not path.exists():
    return None
  files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
  digest = hashlib.sha256()
  for file in files:
    size = file.stat().st_size
    digest.update(f"{file.relative_to(path) if path.is_dir() else ''}:{size}\n".encode())
    with open(file, "rb") as f:
      digest.update(f.read(SAMPLED))
      if size > SAMPLED:
        f.seek(max(SAMPLED, size - SAMPLED))
        digest.update(f.read())
  return digest.hexdigest()[:16]
