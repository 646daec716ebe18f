"""Suite-wide settings: 8 simulated CPU devices, so that sharded decoding is tested on a mesh
(tests/test_sharding.py), and what makes the suite's hundreds of compilations cheap. Programs not
given a mesh run on the first device, as on a machine with one.

Most of the suite's time is XLA:CPU compiling (a decode loop over a 3-layer random model takes
longer to compile than to run), so before jax starts:

- On the CPU, LLVM optimises the suite's programs less (`--xla_backend_optimization_level=0`,
  unless $XLA_FLAGS names a level): about a third less time compiling. XLA's own passes run as
  always; LLVM may round a multiply-add differently, and every test compares results computed
  under the same flags (or within a tolerance, against PyTorch). Launcher subprocesses inherit
  it. CI's real generations (the README's command, .ci/runtime_smoke) keep the shipped defaults.
- XLA:CPU emits its fusions the older way, straight to LLVM IR (`--xla_cpu_use_fusion_emitters=
  false`, unless $XLA_FLAGS names it), not through its MLIR emitters: at -O0 that compiles the
  suite's many small programs in about 40% less time (tests/test_hierarchy.py's greedy tests:
  49 s of compiling down to 28 s), and the whole suite took 3,405 worker-seconds instead of
  4,230 (docs/results/suite/suite_time.md). On the real SmolLM2 at a 2K-token prompt it is the other
  way round (TriForce from cold: 48 s instead of 39 s at -O0; 68 s instead of 42 s at XLA's
  default -O2; an `sd` stack at 500 tokens: 15.5 s instead of 12.8 s), so the launchers that
  compile it drop it (tests/helpers.py real_model_environ), and the product keeps XLA's default.
- Programs go to the persistent compilation cache (compile_cache: $HITREE_COMPILE_CACHE, else
  <assets>/xla_cache, shared with the launcher subprocesses and both pytest-xdist workers), so a
  program that two tests or two modules compile is compiled once.
- Launcher subprocesses start with glibc's huge-page tunable already set, so they do not restart
  themselves for it (hitree_jax/huge_pages.py), which would import everything twice.
- PyTorch's OpenMP threads (the parity references, the `hf` peer) wait passively. Two workers
  share two cores, and a spinning thread holds the core that the thread it waits for needs: a
  16-token PyTorch decode beside two busy processes took 8.3 s spinning and 1.4 s passive.
"""

import gc
import os

# The suite runs on the CPU: jax[tpu] is a test package (tests/test_tpu_compile.py compiles for a
# TPU slice without one), and without this every process would look for a TPU first.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if os.environ["JAX_PLATFORMS"] == "cpu":
  for _flag, _value in (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false")):
    if _flag not in _flags:
      _flags = f"{_flags} --{_flag}={_value}".strip()
  os.environ["XLA_FLAGS"] = _flags

from hitree_jax import huge_pages  # noqa: E402  (imports no jax)

os.environ.update(huge_pages.launcher_environ(os.environ))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when torch loads

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the CPU backend

from hitree_jax import compile_cache  # noqa: E402
from hitree_jax.decode import programs  # noqa: E402

compile_cache.enable()
# Eager operations compile in milliseconds: reading them back would cost as much as compiling.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """After each test module, drop its compiled programs: XLA:CPU keeps every program's machine
  code mapped, and the whole suite's programs at once ran it out of memory for code (an abort
  while compiling, late in the run). The persistent compilation cache makes recompiling cheap."""
  yield
  programs.shared().clear()
  jax.clear_caches()
  gc.collect()



# The distillation tests' tiny teacher (tests/test_distill.py, tests/test_heads_training.py): its
# params and the data labelled with it, once per module that asks.

@pytest.fixture(scope="module")
def teacher_params():
  """Random params of tests/helpers.py's TEACHER."""
  from hitree_jax.model.llama import init_params
  from tests.helpers import TEACHER
  params = init_params(TEACHER, jax.random.key(0))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, params)  # peaked predictions


@pytest.fixture(scope="module")
def distill_data(teacher_params):
  """Windows of a noisy periodic token stream (learnable), labelled with the teacher's top-8:
  (windows, ids, log_probs, vocab)."""
  import numpy as np
  from hitree_jax.model.vocab import ReducedVocab
  from hitree_jax.train import distill, teacher
  from tests.helpers import TEACHER
  rng = np.random.default_rng(0)
  stream = np.tile(rng.integers(3, 40, 13), 200)
  stream = np.where(rng.random(stream.shape) < 0.1, rng.integers(0, 40, stream.shape), stream)
  windows = distill.corpus.evenly_spaced_windows(stream.astype(np.int32), 24, 48)
  ids, log_probs = teacher.teacher_topk(teacher_params, TEACHER, windows, k=8, batch=16)
  vocab = ReducedVocab.most_frequent(np.bincount(stream, minlength=40), 30)
  return windows, ids, log_probs, vocab

# pytest-xdist (--dist loadfile --no-loadscope-reorder) hands out test files in collection order
# (by default it would hand out the files with the most tests first, whatever their length), and a
# long file handed out last runs alone at the end: run 11's suite ended on one worker for about
# 100 s. So the longest files (docs/results/suite/suite_time.md) go first, each keeping its own order.
LONGEST_FIRST = ("test_smollm2.py", "test_sharding.py", "test_tpu_compile.py", "test_launch.py",
                 "test_planner.py", "test_hierarchy.py", "test_engine.py", "test_cli.py", "test_distill_launch.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file keeps its order
