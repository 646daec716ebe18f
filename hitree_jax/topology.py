"""TPU slices to compile for without a TPU: the TPU compiler, from `libtpu`, behind jax's topologies.

`pip install "jax[tpu]"` (./setup.sh --tpu) brings libtpu, and with it the compiler a TPU runs.
`jax.experimental.topologies` then describes a slice by name ("v5e:2x4": eight v5e chips) as
compile-only devices: programs lowered with abstract arrays sharded over a mesh of them compile
with the TPU compiler's own fusions, layouts and buffer assignment, so `memory_analysis()` and
`cost_analysis()` are its figures, not XLA:CPU's. Nothing runs: a concrete array placed on those
devices fails, so everything handed to such a program must be abstract (jax.ShapeDtypeStruct).
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import pathlib
import re
import sys

from hitree_jax.errors import UsageError

EXAMPLES = "v5e:1x1, v5e:2x2, v5e:2x4, v6e:2x4, v5p:2x2x1, v4:2x2x1"


def tpu_compiler_installed() -> bool:
  """Whether libtpu (the TPU compiler) is importable: `pip install "jax[tpu]"`."""
  return importlib.util.find_spec("libtpu") is not None


GOOGLE_PCI_VENDOR = "0x1ae0"   # a TPU chip on the PCI bus (as jax's own hardware_utils looks)
NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def tpu_attached() -> bool:
  """Whether this machine has a TPU chip: a Google device on its PCI bus."""
  return any(pathlib.Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR
             for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"))


def skip_absent_tpu() -> None:
  """Keeps jax to the CPU where libtpu is installed (to compile for a TPU on paper) but no TPU
  and no NVIDIA GPU is attached. Otherwise jax's start-up looks for a TPU and prints libtpu's
  failure, a dozen lines that read as an error, before everything a launcher says. An explicit
  JAX_PLATFORMS is kept; --topology compiles with the CPU as its host either way. Importing
  hitree_jax calls this too; where jax was imported first, its platforms setting is updated
  (jax reads the variable at its own import), which counts until jax first picks a backend."""
  if (os.environ.get("JAX_PLATFORMS") or not tpu_compiler_installed() or tpu_attached()
      or any(os.path.exists(node) for node in NVIDIA_DEVICE_NODES)):
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:
    sys.modules["jax"].config.update("jax_platforms", "cpu")


def devices(name: str) -> list:
  """The compile-only devices of a TPU slice named as jax names them ("v5e:2x4"), in jax's order.

  A slice smaller than one host's chips ("v5e:1x1", one chip) is described as one host of that
  size. Raises ValueError naming the topology where libtpu is absent or does not know it.
  """
  check_name(name)
  if not tpu_compiler_installed():
    raise UsageError(f"--topology={name}: the TPU compiler is not installed (pip install \"jax[tpu]\", "
                     "or ./setup.sh --tpu)")
  # Without a TPU VM's metadata, libtpu logs an error looking for its peers; there are none. Nor is
  # there a TPU to guard: processes compiling at once need not take turns at libtpu's lockfile.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  chips = chips_of(name)
  bounds = {"chips_per_host_bounds": tuple(chips + [1] * (3 - len(chips)))} if _single_host(chips) else {}
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **bounds).devices)
  except Exception as error:  # the plugin's own error names what it did not accept
    raise UsageError(f"--topology={name}: {error}") from None


def chips_of(name: str) -> list[int]:
  """A slice's chips along each axis ('v5e:2x4' -> [2, 4])."""
  check_name(name)
  return [int(n) for n in name.split(":")[1].split("x")]


def chip_kind(name: str) -> str:
  """A slice's chip ('v5e' of 'v5e:2x4')."""
  check_name(name)
  return name.split(":")[0]


def check_name(name: str) -> None:
  """Refuses a name that is not a TPU slice's ("v5e:2x4"), naming it."""
  if not re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)+", name):
    raise UsageError(f"--topology={name!r}: expected a TPU slice such as {EXAMPLES}")


def _single_host(chips: list[int]) -> bool:
  """Slices below a host's 2x2 chips (one chip, 1x2) need their host bounds said."""
  return chips[0] * chips[1] < 4


def compile_only() -> None:
  """Sets jax up to compile for a slice it does not have: on the CPU unless JAX_PLATFORMS says
  otherwise (no TPU is looked for), and without the persistent compilation cache, which cannot
  load back a program compiled for devices that are not there."""
  import jax
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_enable_compilation_cache", False)


def mesh(name: str, spec: str | None = None):
  """A mesh over a TPU slice's compile-only devices: `spec` (AXIS:N,...; default model:N over
  all of them). Compiling for it needs no TPU, so jax is kept to the CPU unless JAX_PLATFORMS
  says otherwise. Raises ValueError naming the slice or the mesh that is wrong."""
  from hitree_jax import sharding
  compile_only()
  found = devices(name)
  axes = sharding.parse_mesh(spec or f"model:{len(found)}")
  if not axes:
    raise UsageError(f"--mesh={spec!r}: name the mesh, e.g. model:{len(found)}")
  needed = math.prod(axes.values())
  if needed > len(found):
    raise UsageError(f"--mesh={spec} needs {needed} devices; --topology={name} has {len(found)}")
  return sharding.make_mesh(axes, found)
