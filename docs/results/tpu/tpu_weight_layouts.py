"""The 7B TriForce plan's decode loop and prefill chunk for v5e-8 (configs/llama2_7b_128k.py,
model:8), compiled by the TPU compiler with the weights in three layouts: JAX's defaults, left to
the compiler (Layout.AUTO), and the layouts it chose given back as concrete formats. Prints each
program's temporaries and how many weights the compiler laid out transposed. Needs libtpu (the
test packages); no TPU:

  JAX_PLATFORMS=cpu python docs/results/tpu/tpu_weight_layouts.py   # about 5 minutes on 2 cores
"""
import collections
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from hitree_jax import memory_plan, sharding, topology  # noqa: E402
from hitree_jax.decode import loop, prefill  # noqa: E402

GIB = 2**30
spec = importlib.util.spec_from_file_location("shapes", ROOT / "configs/llama2_7b_128k.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
cfg = module.get_config()
mesh = topology.mesh("v5e:2x4", "model:8")
target, draft_config = memory_plan.shapes_models(cfg)
stack = memory_plan.shapes_stack(cfg, target, draft_config)


def temporaries(compiled) -> str:
  return f"{compiled.memory_analysis().temp_size_in_bytes / GIB:.3f} GiB"


with sharding.use(mesh):
  a = memory_plan.decode_arguments(target, stack, mesh, cfg.prompt_tokens, cfg.max_new_tokens)
  weights, longs, start, last = a.weights, a.longs, a.start, a.lengths
  shardings = lambda tree: jax.tree.map(lambda s: s.sharding, tree)
  decode = lambda weight_formats: jax.jit(
      lambda w, l, s: loop.generation(a.sizes, w, l, s, cfg.max_new_tokens),
      in_shardings=(weight_formats, shardings(longs), shardings(start)), donate_argnums=(1,))
  chunk = jax.ShapeDtypeStruct((1, prefill.prefill_chunk_size(cfg.prompt_tokens)), jnp.int32)
  hidden = jax.ShapeDtypeStruct((1, target.hidden_size), jnp.dtype(target.dtype))
  prefill_chunk = lambda p: prefill.prefill_chunk.lower(p, target, a.full, chunk, memory_plan.scalar(jnp.int32),
                                                        last, hidden).compile()

  print("weights in JAX's default layouts: decode loop", temporaries(decode(shardings(weights)).lower(
      weights, longs, start).compile()), "| prefill chunk", temporaries(prefill_chunk(a.params)), flush=True)
  auto = decode(jax.tree.map(lambda s: Format(Layout.AUTO, s.sharding), weights)).lower(weights, longs, start).compile()
  chosen = auto.input_formats[0][0]
  print("weights left to the compiler (Layout.AUTO): decode loop", temporaries(auto), flush=True)
  print("  2-D weights by major_to_minor:", dict(collections.Counter(
      f.layout.major_to_minor for f in jax.tree.leaves(chosen) if len(f.layout.major_to_minor) == 2)))
  print("  caches' arrays by major_to_minor:", dict(collections.Counter(
      f.layout.major_to_minor for f in jax.tree.leaves(auto.input_formats[0][1]))))
  given = jax.tree.map(lambda s, f: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=f), weights, chosen)
  print("weights in those layouts, given back: decode loop", temporaries(decode(chosen).lower(
      weights, longs, start).compile()), "| prefill chunk", temporaries(prefill_chunk(given.target)), flush=True)
