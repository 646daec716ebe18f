"""The Colab notebook runs top to bottom, headless, on a tiny config over 2 simulated devices."""

import pathlib

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "hitree_colab.ipynb"


def test_notebook_runs_top_to_bottom(monkeypatch):
  monkeypatch.setenv("HITREE_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on a cell error
  text = "\n".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
  assert "mesh: model:2" in text                       # the devices present, split by head
  assert "greedy output of every stack == ar's" in text
  for label in ("ar", "sd/draft/3", "hitree (retrieval 128)"):
    assert label in text
  images = [out for cell in notebook.cells for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})]
  assert len(images) == 1                              # the acceptance plot
