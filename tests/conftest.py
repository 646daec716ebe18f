"""Suite-wide hygiene: one pytest process compiles hundreds of programs; and 8 simulated CPU
devices, so that sharded decoding is tested on a mesh (tests/test_sharding.py). Programs not
given a mesh run on the first device, as on a machine with one."""

import gc
import os

# The suite runs on the CPU: jax[tpu] is a test package (tests/test_tpu_compile.py compiles for a
# TPU slice without one), and without this every process would look for a TPU first.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the CPU backend

from hitree_jax.decode import programs


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """After each test module, drop its compiled programs: XLA:CPU keeps every program's machine
  code mapped, and the whole suite's programs at once ran it out of memory for code (an abort
  while compiling, late in the run). The persistent compilation cache makes recompiling cheap."""
  yield
  programs.shared().clear()
  jax.clear_caches()
  gc.collect()
