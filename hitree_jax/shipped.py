"""The files the repository ships beside the library (drafts/, configs/, data/), found from any directory.

A path that does not exist where it is given is looked up in the repository the package runs
from (the clone, or the folder an editable install points to: ./setup.sh installs so), then in
the shipped folder; an installed wheel carries the same folders as package data
(hitree_jax/files/, pyproject.toml), looked up the same way. So `--draft=smollm2-draft`,
`eagle:smollm2-eagle` and `--config=methods:sd` name the shipped draft, EAGLE draft and config
from anywhere.
"""

from __future__ import annotations

import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent   # the repository (hitree_jax/..)
PACKAGED = pathlib.Path(__file__).resolve().parent / "files"   # the same folders in a wheel
HEADS_META = "heads.json"   # what marks a folder of trained EAGLE or Medusa heads (heads/saved.py)


def find(path: str | os.PathLike, folder: str = "drafts", suffixes: tuple[str, ...] = ("", ".gguf")) -> pathlib.Path:
  """`path` if it exists (or is absolute), else ROOT/path, else ROOT/folder/path (then the same
  under PACKAGED), each with `suffixes` tried in turn; else `path` unchanged, for the caller's
  error to name."""
  given = pathlib.Path(path).expanduser()
  if given.exists() or given.is_absolute() or not str(path):
    return given
  for base in (ROOT, ROOT / folder, PACKAGED, PACKAGED / folder):
    for suffix in suffixes:
      candidate = base / f"{given}{suffix}"
      if candidate.exists():
        return candidate
  return given


def heads_kind(path: str | os.PathLike) -> str | None:
  """The kind ("eagle", "eagle3", "medusa", "dflash") of the trained or published draft `path`
  names (as given or shipped), from its heads.json or its config.json alone (published_kind);
  None where it names no such folder. Light: heads/saved.py reads them."""
  folder = find(path)
  if (folder / HEADS_META).is_file():
    return json.loads((folder / HEADS_META).read_text())["kind"]
  return published_kind(folder)


def published_kind(folder: pathlib.Path) -> str | None:
  """The kind of draft another project published in `folder`, by its config.json: "medusa"
  (FasterDecoding's medusa_num_heads), "dflash" (z-lab's dflash_config or speculators' dflash),
  "eagle3" (the EAGLE authors' LlamaForCausalLMEagle3 or speculators' eagle3); None for anything
  else."""
  try:
    config = json.loads((pathlib.Path(folder) / "config.json").read_text())
  except (OSError, ValueError):
    return None
  if not isinstance(config, dict):
    return None
  if (config.get("speculators_model_type") == "eagle3"
      or "LlamaForCausalLMEagle3" in config.get("architectures", ())):
    return "eagle3"
  if "dflash_config" in config or config.get("speculators_model_type") == "dflash":
    return "dflash"
  return "medusa" if "medusa_num_heads" in config else None


def file(folder: str, name: str) -> pathlib.Path:
  """The file NAME the repository ships in `folder` (the clone's, else the installed package's),
  whatever the working directory holds."""
  return ROOT / folder / name if (ROOT / folder / name).exists() else PACKAGED / folder / name


def names(folder: str, suffix: str = "") -> list[str]:
  """The names of the `suffix` files the repository ships in `folder` (configs, ".py": methods,
  models, ...), for an error to list."""
  where = ROOT / folder if (ROOT / folder).is_dir() else PACKAGED / folder
  return sorted(p.name.removesuffix(suffix) for p in where.glob(f"*{suffix}")
                if not p.name.startswith((".", "_")))


def config(name: str):
  """get_config() of the shipped configs/NAME.py, for a recipe that extends another (the chat
  drafts' recipes are the book drafts' with another text)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"shipped_config_{name}", find(name, "configs", (".py",)))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()
