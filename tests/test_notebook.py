"""The Colab notebook runs top to bottom, headless, on a tiny config over 2 simulated devices: in
the test venv, and in a kernel whose environment had another jax installed, as Colab's has."""

import os
import pathlib
import subprocess
import sys
import sysconfig

import nbclient
import nbformat
import pytest

from tests.helpers import REPO
NOTEBOOK = REPO / "notebooks" / "hitree_colab.ipynb"
# conftest's XLA flags, and two simulated devices
TINY_ON_TWO_DEVICES = {"HITREE_NOTEBOOK_TINY": "1", "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                                                                 "--xla_force_host_platform_device_count=2".strip()}


def printed(notebook) -> str:
  return "\n".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(monkeypatch):
  for name, value in TINY_ON_TWO_DEVICES.items():
    monkeypatch.setenv(name, value)
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on a cell error
  text = printed(notebook)
  assert "mesh: model:2" in text                       # the devices present, split by head
  assert "greedy output of every stack == ar's" in text
  for label in ("ar", "sd/draft/3", "hitree (retrieval 128)"):
    assert label in text
  images = [out for cell in notebook.cells for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})]
  assert len(images) == 1                              # the acceptance plot


RUN_NOTEBOOK = """
import sys, nbclient, nbformat
notebook = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(notebook, sys.argv[3])
"""


@pytest.mark.slow
def test_notebook_installs_the_pinned_jax_over_another(tmp_path):
  """A venv that sees the test venv's packages but has jax 0.10.1 of its own, first on the path
  (Colab preinstalls a jax of its own): the first cell installs the pinned jax in its place,
  before anything imports jax, and the notebook runs on it."""
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = venv / "bin" / "python"
  own = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
  (own / "test_venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
  install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "jax==0.10.1"],
                           capture_output=True, text=True, timeout=600)
  assert install.returncode == 0, install.stderr[-2000:]
  pinned = next(line.split("==")[1].strip() for line in (REPO / "requirements.txt").read_text().splitlines()
                if line.startswith("jax=="))
  assert pinned != "0.10.1"
  env = {**os.environ, **TINY_ON_TWO_DEVICES, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
  out = tmp_path / "ran.ipynb"
  run = subprocess.run([str(python), "-c", RUN_NOTEBOOK, str(NOTEBOOK), str(NOTEBOOK.parent), str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-4000:]
  text = printed(nbformat.read(out, as_version=4))
  assert f"| jax {pinned} |" in text and "greedy output of every stack == ar's" in text
  assert (own / f"jax-{pinned}.dist-info").is_dir() and not (own / "jax-0.10.1.dist-info").exists()
