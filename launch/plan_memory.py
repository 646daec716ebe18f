"""Will a generation fit on a mesh of accelerators? Per-device memory, compiled without them.

  python -m launch.plan_memory --shapes=configs/llama2_7b_128k.py --topology=v5e:2x4
  python -m launch.plan_memory --shapes=configs/llama2_7b_128k.py --mesh=model:8 --device=v5e

The config names the target's shape and a stack: TriForce's, with its draft model's shape
(configs/llama*_128k.py), or any `levels`, such as a published draft read from its config.json
alone, before its weights are downloaded (configs/llama3_8b_eagle3.py, configs/qwen3_8b_dflash.py).
The prefill, the retrieval selection and the decode loop are compiled for the mesh with abstract
weights (hitree_jax/memory_plan.py), and the per-device bytes of the weights, of each cache and of
each program's temporaries are printed, with whether the largest program fits the device.

With --topology (a TPU slice: v5e:2x4, v6e:2x4, v5p:2x2x1, ...) and the TPU compiler installed
(pip install "jax[tpu]", ./setup.sh --tpu; no TPU needed), the programs are compiled by the TPU
compiler for that slice and the figures are its own (`compiler: "tpu"`). Otherwise they are
compiled for simulated CPU devices (`compiler: "cpu-simulated"`): an estimate, said so. With
--json the last line is one JSON record (`fits`: true or false).
"""

from __future__ import annotations

import json
import math
import os

from absl import flags
from ml_collections import config_flags

from hitree_jax.errors import UsageError
from . import common

config_flags.DEFINE_config_file("shapes", None, "A shapes config: configs/llama2_7b_128k.py, "
                                "configs/llama3_8b_128k.py (--shapes.budget=8192 overrides a field).")
flags.DEFINE_string("topology", None, "A TPU slice to compile for with the TPU compiler, without a "
                    "TPU: v5e:1x1 (one chip), v5e:2x2, v5e:2x4, v6e:2x4, v5p:2x2x1, v4:2x2x1, ... "
                    "Needs libtpu (pip install \"jax[tpu]\"); without it the plan is simulated on CPU "
                    "devices and labelled an estimate.")
flags.DEFINE_string("mesh", None, "The mesh to plan for, AXIS:N,... (data, sequence, model). Default: "
                    "model:N over the topology's N devices, or model:8.")
flags.DEFINE_string("device", None, "Memory per device: an accelerator (v5e 16 GiB, v5p 95, v6e 32, "
                    "v4 16, a100 80, h100 80, h200 141) or a number of GiB. Default: the topology's "
                    "chip, or v5e.")
flags.DEFINE_bool("json", False, "Print one JSON record as the last line.")
FLAGS = flags.FLAGS


def device_gib(spec: str) -> float:
  from hitree_jax.memory_plan import DEVICE_MEMORY_GIB
  if spec in DEVICE_MEMORY_GIB:
    return float(DEVICE_MEMORY_GIB[spec])
  try:
    gib = float(spec)
  except ValueError:
    raise UsageError(f"--device={spec!r}: expected one of {sorted(DEVICE_MEMORY_GIB)} or a number of "
                     "GiB") from None
  if not gib > 0:
    raise UsageError(f"--device={spec}: GiB must be > 0")
  return gib


def main(argv):
  del argv
  cfg = FLAGS.shapes
  if cfg is None:
    raise UsageError("--shapes: name a shapes config, e.g. configs/llama2_7b_128k.py")
  from hitree_jax import sharding, topology
  tpu = FLAGS.topology is not None and topology.tpu_compiler_installed()
  if FLAGS.topology is not None:
    topology.compile_only()  # the TPU compiler needs no TPU here: do not look for one
  devices = topology.devices(FLAGS.topology) if tpu else None
  slice_size = len(devices) if tpu else _slice_size(FLAGS.topology)
  axes = sharding.parse_mesh(FLAGS.mesh if FLAGS.mesh is not None else f"model:{slice_size or 8}")
  if not axes:
    raise UsageError("--mesh: name the mesh to plan for, e.g. model:8")
  gib = device_gib(FLAGS.device or _chip(FLAGS.topology) or "v5e")
  needed = math.prod(axes.values())
  if slice_size is not None and needed > slice_size:
    raise UsageError(f"--mesh={FLAGS.mesh} needs {needed} devices; --topology={FLAGS.topology} has {slice_size}")
  if not tpu and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    import jax
    jax.config.update("jax_num_cpu_devices", needed)  # simulated: the plan needs no accelerator
  import jax
  from hitree_jax import memory_plan, provenance

  target, draft = memory_plan.shapes_models(cfg)
  mesh = sharding.make_mesh(axes, devices if tpu else jax.devices("cpu"))
  plan = memory_plan.plan(target, draft, lambda d: memory_plan.shapes_stack(cfg, target, d), mesh,
                          cfg.prompt_tokens, cfg.max_new_tokens, cfg.batch)
  plan.update(device=FLAGS.device or _chip(FLAGS.topology) or "v5e", device_gib=gib,
              fits=plan["peak"] <= gib * memory_plan.GIB, spare=1 - plan["peak"] / (gib * memory_plan.GIB),
              topology=FLAGS.topology, config=config_flags.get_config_filename(FLAGS["shapes"]),
              prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens, budget=cfg.get("budget"),
              levels=cfg.get("levels"), **provenance.stamp(),
              libtpu=provenance.libtpu_version() if tpu else None)
  print(report(plan))
  if FLAGS.json:
    print(json.dumps(plan))


def _chip(name: str | None) -> str | None:
  """The device name of a topology ('v5e' of 'v5e:2x4'), as --device takes it."""
  from hitree_jax import topology
  return None if name is None else topology.chip_kind(name)


def _slice_size(name: str | None) -> int | None:
  """Chips in a topology's name ('v5e:2x4' -> 8); None without one."""
  from hitree_jax import topology
  return None if name is None else math.prod(topology.chips_of(name))


def report(plan: dict) -> str:
  from hitree_jax.memory_plan import readable as g
  source = ("the TPU compiler's figures" if plan["compiler"] == "tpu" else
            "an estimate: compiled by XLA:CPU on simulated devices")
  lines = [f"{plan['device_kind']} x {plan['devices']} ({source})",
           f"per device of {plan['devices']} ({plan['mesh']}), {plan['slots']} cache slots:",
           f"  {'target weights':<32}{g(plan['params'])}"]
  if plan["draft_params"]:
    lines.append(f"  {'draft weights':<32}{g(plan['draft_params'])}")
  lines += [f"  {name:<32}{g(size)}" for name, size in plan["caches"].items()]
  lines.append("programs (arguments + outputs not donated + temporaries = peak):")
  for p in plan["programs"]:
    lines.append(f"  {p['name']:<32} {g(p['arguments'])} + {g(p['outputs'] - p['aliased'])} + "
                 f"{g(p['temporaries'])} = {g(p['peak'])}")
  verdict = "fits" if plan["fits"] else "does NOT fit"
  lines.append(f"peak {g(plan['peak'])} of {plan['device_gib']:g} GiB ({plan['device']}): {verdict}, "
               f"{plan['spare']:.0%} spare")
  return "\n".join(lines)


def run():
  common.run(main, config_sets_flags=False)


if __name__ == "__main__":
  run()
