"""Launchers restart once with glibc's malloc asking for 2 MB pages (hitree_jax/huge_pages.py)."""

import os
import subprocess
import sys

import pytest

from hitree_jax import huge_pages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_thp_mode_is_the_bracketed_word(tmp_path):
  path = tmp_path / "enabled"
  path.write_text("always [madvise] never\n")
  assert huge_pages.thp_mode(path) == "madvise"
  path.write_text("[always] madvise never\n")
  assert huge_pages.thp_mode(path) == "always"
  assert huge_pages.thp_mode(tmp_path / "missing") is None


@pytest.mark.parametrize("environ, mode, libc, expected", [
    ({}, "madvise", "glibc", True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", "glibc", True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}, "madvise", "glibc", False),
    ({}, "always", "glibc", False),      # every mapping gets them already
    ({}, "never", "glibc", False),       # none can
    ({}, None, "glibc", False),          # no THP (not Linux)
    ({}, "madvise", "", False),          # another C library: the tunable means nothing
    ({"HITREE_HUGE_PAGES": "0"}, "madvise", "glibc", False),
])
def test_should_reexec(environ, mode, libc, expected):
  assert huge_pages.should_reexec(environ, mode, libc) is expected


def test_the_tunable_joins_the_others_and_stops_the_restart():
  environ = huge_pages.environ_with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
  assert environ == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME": "/h"}
  assert not huge_pages.should_reexec(environ, "madvise", "glibc")
  assert huge_pages.environ_with_tunable({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_describe():
  assert huge_pages.describe({}, "madvise").startswith("4 KB pages")
  assert huge_pages.describe(huge_pages.environ_with_tunable({}), "madvise").startswith("2 MB pages")
  assert huge_pages.describe({}, "always").startswith("2 MB pages")
  assert huge_pages.describe({}, "never").startswith("4 KB pages")


def test_a_launcher_restarts_with_the_tunable_and_keeps_its_arguments():
  """`launch.plan_memory` (no model to load) started without the tunable runs with it, where
  the machine's THP mode makes that worth a restart; its flags survive the restart."""
  environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "HITREE_HUGE_PAGES")}
  probe = ("import os, runpy, sys; sys.argv = ['launch.plan_memory', '--help'];"
           "print('TUNABLES=' + os.environ.get('GLIBC_TUNABLES', ''), flush=True);"
           "runpy.run_module('launch.plan_memory', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=environ, capture_output=True,
                        text=True, timeout=300)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("TUNABLES=")]
  if huge_pages.launcher_environ(environ) is not environ:  # it restarts: without it, then with it
    assert lines == ["TUNABLES=", "TUNABLES=glibc.malloc.hugetlb=1"], proc.stdout[-2000:]
  else:
    assert lines == ["TUNABLES="], proc.stdout[-2000:]
  assert "USAGE: launch.plan_memory" in proc.stdout and "--mesh" in proc.stdout  # it still saw --help


@pytest.mark.parametrize("argv, expected", [
    (["python", "-m", "launch.generate", "--model=smollm2"], True),
    (["python", "-X", "importtime", "-m", "hitree_jax.launch.plan"], True),
    (["python", "-mlaunch.benchmark"], True),
    ([".venv/bin/python", ".venv/bin/hitree-generate", "--prompt=Hi"], True),
    (["python", "-m", "pytest", "-n", "2", "tests"], False),
    (["python", "-c", "import launch.common"], False),
    (["python", "examples/my_script.py", "-m", "launch.generate"], False),
    (["python"], False),
])
def test_a_launcher_is_known_by_how_python_was_started(argv, expected):
  import launch
  assert launch.started_as_a_launcher(argv) is expected


def test_a_launcher_restarts_before_its_own_imports():
  """`python -m launch.NAME` restarts when its package is imported, so jax is imported once (by
  the restarted process), not once before the restart and again after it."""
  environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "HITREE_HUGE_PAGES")}
  restarts = huge_pages.launcher_environ(environ) is not environ   # where the THP mode asks for it
  proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "launch.plan_memory", "--help"], cwd=REPO,
                        env=environ, capture_output=True, text=True, timeout=300)
  assert "Per-device memory" in proc.stdout and "--topology" in proc.stdout, proc.stderr[-2000:]  # --help exits 1
  # -X importtime writes a line per module imported: "import time: SELF | CUMULATIVE |   name"
  names = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
  assert names.count("hitree_jax.huge_pages") == (2 if restarts else 1)   # each process imports it
  assert names.count("jax") == 1
