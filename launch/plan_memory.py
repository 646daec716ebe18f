"""Will a generation fit on a mesh of accelerators? Per-device memory, compiled without them.

  python -m launch.plan_memory --config=configs/llama2_7b_128k.py --mesh=model:8 --device=v5e

The config names the target's and the draft's shapes and TriForce's stack (configs/llama*_128k.py).
The prefill, the retrieval selection and the decode loop are compiled for the mesh on simulated
CPU devices, with abstract weights (hitree_jax/memory_plan.py), and the per-device bytes of the
weights, of each cache and of each program's temporaries are printed, with whether the largest
program fits the device. With --json the last line is one JSON record (`fits`: true or false).
"""

from __future__ import annotations

import json
import math
import os

from absl import flags
from ml_collections import config_flags

from launch import common

config_flags.DEFINE_config_file("config", None, "A shapes config: configs/llama2_7b_128k.py, "
                                "configs/llama3_8b_128k.py (--config.budget=8192 overrides a field).")
flags.DEFINE_string("mesh", "model:8", "The mesh to plan for, AXIS:N,... (data, sequence, model).")
flags.DEFINE_string("device", "v5e", "Memory per device: an accelerator (v5e 16 GiB, v5p 95, v6e 32, "
                    "a100 80, h100 80, h200 141) or a number of GiB.")
flags.DEFINE_bool("json", False, "Print one JSON record as the last line.")
FLAGS = flags.FLAGS


def device_gib(spec: str) -> float:
  from hitree_jax.memory_plan import DEVICE_MEMORY_GIB
  if spec in DEVICE_MEMORY_GIB:
    return float(DEVICE_MEMORY_GIB[spec])
  try:
    gib = float(spec)
  except ValueError:
    raise ValueError(f"--device={spec!r}: expected one of {sorted(DEVICE_MEMORY_GIB)} or a number of "
                     "GiB") from None
  if not gib > 0:
    raise ValueError(f"--device={spec}: GiB must be > 0")
  return gib


def stack_of(cfg, draft_config):
  from hitree_jax.decode.drafters import ModelDrafter
  from hitree_jax.decode.stack import Retrieval, Stack, Streaming, Verifier
  from hitree_jax.tree import shapes as tree_lib
  return Stack(ModelDrafter(draft_config, cache=Streaming(cfg.sinks, cfg.window)), tree_lib.chain(cfg.gamma1),
               (Verifier("target", Retrieval(cfg.budget, 8), cfg.gamma2),), draft=draft_config)


def main(argv):
  del argv
  cfg = FLAGS.config
  if cfg is None:
    raise ValueError("--config: name a shapes config, e.g. configs/llama2_7b_128k.py")
  from hitree_jax import sharding
  axes = sharding.parse_mesh(FLAGS.mesh)
  if not axes:
    raise ValueError("--mesh: name the mesh to plan for, e.g. model:8")
  gib = device_gib(FLAGS.device)
  devices = math.prod(axes.values())
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    import jax
    jax.config.update("jax_num_cpu_devices", devices)  # simulated: the plan needs no accelerator
  import jax
  from hitree_jax import memory_plan
  from hitree_jax.model.config import ModelConfig

  target = ModelConfig.from_dict(dict(cfg.target))
  draft = ModelConfig.from_dict(dict(cfg.draft))
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) is not the target's ({target.vocab_size})")
  mesh = sharding.make_mesh(axes, jax.devices("cpu"))
  plan = memory_plan.plan(target, draft, lambda d: stack_of(cfg, d), mesh, cfg.prompt_tokens,
                          cfg.max_new_tokens, cfg.batch)
  plan.update(device=FLAGS.device, device_gib=gib, fits=plan["peak"] <= gib * memory_plan.GIB,
              config=config_flags.get_config_filename(FLAGS["config"]),
              prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens, budget=cfg.budget)
  print(report(plan))
  if FLAGS.json:
    print(json.dumps(plan))


def report(plan: dict) -> str:
  from hitree_jax.memory_plan import readable as g
  lines = [f"per device of {plan['devices']} ({plan['mesh']}), {plan['slots']} cache slots:",
           f"  {'target weights':<32}{g(plan['params'])}"]
  if plan["draft_params"]:
    lines.append(f"  {'draft weights':<32}{g(plan['draft_params'])}")
  lines += [f"  {name:<32}{g(size)}" for name, size in plan["caches"].items()]
  lines.append("programs (arguments + outputs not donated + temporaries = peak):")
  for p in plan["programs"]:
    lines.append(f"  {p['name']:<32} {g(p['arguments'])} + {g(p['outputs'] - p['aliased'])} + "
                 f"{g(p['temporaries'])} = {g(p['peak'])}")
  verdict = "fits" if plan["fits"] else "does NOT fit"
  lines.append(f"peak {g(plan['peak'])} of {plan['device_gib']:.0f} GiB ({plan['device']}): {verdict}")
  return "\n".join(lines)


def run():
  common.run(main, config_sets_flags=False)


if __name__ == "__main__":
  run()
