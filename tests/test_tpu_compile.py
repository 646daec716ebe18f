"""Every preset compiled by the TPU compiler for a v5e slice, without a TPU (hitree_jax/topology.py).

libtpu is a test package (requirements-test.txt: jax[tpu]), so the TPU compiler's own memory
analysis checks what the CPU simulation cannot: that the decode loop updates the long caches in
place on a TPU (it once copied each layer's full cache into a layout of its own: cache/full.py
put_slots; and, for head_dim 64, into another layout: KVCache), on one chip and on a 4-chip mesh
that splits heads and slots. Nothing is allocated: the arrays are shapes. The model is tiny but
its full cache is long (120,000 prompt tokens, 4 layers of 16 KV heads of 64: 2 GB), so that it
outweighs what a round computes and the few MiB a TPU program keeps for itself, as a
long-context cache does.
"""

import functools
import json
import subprocess
import sys

import numpy as np
import pytest

from hitree_jax import memory_plan, sharding, topology
from hitree_jax.decode.drafters import ModelDrafter
from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.heads import eagle
from hitree_jax.heads.drafter import EagleDrafter, MedusaDrafter
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree import shapes as tree_lib
from tests.helpers import DRAFT, REPO, TARGET, TINY_SHAPES, kv_bytes  # the model: test_roofline's too

PROMPT, NEW = 120_000, 32
RETRIEVAL = Retrieval(256, 8)
STREAMING = Streaming(4, 60)
PRESETS = {
    "ar": Stack(),
    "sd": Stack(ModelDrafter(DRAFT), tree_lib.chain(4)),
    "tree": Stack(ModelDrafter(DRAFT), tree_lib.kary(2, 2)),
    "eagle": Stack(EagleDrafter(eagle.layer_config(TARGET, TARGET.vocab_size)), tree_lib.chain(4)),
    "eagle-2": Stack(EagleDrafter(eagle.layer_config(TARGET, TARGET.vocab_size)), tree_lib.DynamicTree(8, 4, 4)),
    "medusa": Stack(MedusaDrafter(3, TARGET.vocab_size), tree_lib.kary(2, 3)),
    "retrieval": Stack(ModelDrafter(TARGET, mode="iid", cache=RETRIEVAL, weights="target"), tree_lib.chain(4)),
    "triforce": Stack(ModelDrafter(DRAFT, cache=STREAMING), tree_lib.chain(1),
                      (Verifier("target", RETRIEVAL, 6),)),
    "hitree": Stack(ModelDrafter(DRAFT, cache=STREAMING), tree_lib.kary(2, 2),
                    (Verifier("target", RETRIEVAL, 6),)),
    "hsd": Stack(ModelDrafter(DRAFT, cache=STREAMING), tree_lib.chain(2),
                 (Verifier("draft", Full(), 3), Verifier("target", RETRIEVAL, 5))),
}
MESHES = ("model:1", "sequence:2,model:2")
# Every preset on the 4-chip mesh, whose programs hold everything a one-chip program does and the
# splits besides. On one chip, the presets that together hold every cache kind and drafter there:
# HSD (a draft model over a StreamingLLM cache, a middle level over a full cache, the target over a
# retrieval cache), the target drafting over its retrieval cache, and the feature drafts (EAGLE's
# dynamic tree, Medusa's heads). The other six one-chip compiles, each a chain or tree of those
# parts, were 78 s of the suite (docs/results/suite/suite_time.md, run 41).
ONE_CHIP = ("hsd", "retrieval", "eagle-2", "medusa")
COMPILED = [(name, MESHES[-1]) for name in PRESETS] + [(name, MESHES[0]) for name in ONE_CHIP]


@pytest.fixture(scope="module")
def devices():
  return topology.devices("v5e:2x2")


def weight_bytes(config: ModelConfig, split: int) -> int:
  """A Llama's weights per device, by hand, with heads, MLP and vocabulary split `split` ways."""
  e, f, h, kvh, d, v = (config.hidden_size, config.intermediate_size, config.num_heads,
                        config.num_kv_heads, config.head_dim, config.vocab_size)
  layer = (e * h * d * 2 + 2 * e * kvh * d + 3 * e * f) // split + 2 * e   # + its 2 norms
  return 2 * (config.num_layers * layer + 2 * e * v // split + e)          # + embedding, head, norm


@functools.lru_cache(maxsize=None)
def decode_loop_for_a_tpu(name: str, mesh_spec: str):
  """The preset's decode loop compiled by the TPU compiler over the arguments a generation would
  give it (memory_plan.decode_arguments), and its memory analysis. The decode loop alone: it is
  where a long cache could be copied every round (the prefill chunk and the retrieval selection
  run once, and plan() compiles them too: test_plan_counts_the_arrays_by_hand). Compiled once
  per preset and mesh: two tests read triforce's (10-20 s a compile)."""
  mesh = sharding.make_mesh(mesh_spec, topology.devices("v5e:2x2"))
  with sharding.use(mesh):
    args = memory_plan.decode_arguments(TARGET, PRESETS[name], mesh, PROMPT, NEW)
    return args, memory_plan.decode_loop_program(args, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh_spec", COMPILED)
def test_every_preset_compiles_for_a_tpu_and_updates_its_caches_in_place(devices, name, mesh_spec):
  mesh = sharding.make_mesh(mesh_spec, devices)
  args, decode = decode_loop_for_a_tpu(name, mesh_spec)
  model, sequence = mesh.shape["model"], mesh.shape["sequence"]
  full = kv_bytes(TARGET, args.slots, model, sequence)
  weights = memory_plan.per_device_bytes(args.weights)
  caches = memory_plan.per_device_bytes(args.longs)
  assert memory_plan.per_device_bytes(args.params) == weight_bytes(TARGET, model)  # counted by hand
  assert memory_plan.per_device_bytes(args.full) == full + 4                       # + the lengths
  # Its arguments are the weights and the long caches, and what the loop starts from (the first
  # logits, the token buffer, the settings), each padded to the TPU's tiles: a few % here.
  assert weights + caches <= decode.arguments <= 1.05 * (weights + caches)
  assert decode.aliased >= caches                                   # every cache in place
  # No copy of the long cache: what a round computes is small beside it.
  assert decode.temporaries < 0.1 * full, (decode, full)


@pytest.mark.slow
def test_plan_counts_the_arrays_by_hand(devices):
  """plan() on a TPU slice: the TPU compiler's figures for every program of a generation (the
  prefill chunk, the retrieval selection, the decode loop), and the arrays as counted by hand."""
  mesh = sharding.make_mesh(MESHES[-1], devices)
  plan = memory_plan.plan(TARGET, DRAFT, lambda _: PRESETS["triforce"], mesh, PROMPT, NEW)
  assert plan["compiler"] == "tpu" and plan["device_kind"] == "TPU v5 lite"
  assert [p["name"] for p in plan["programs"]] == ["prefill chunk", "retrieval selection (level 1)",
                                                   "decode loop"]
  model, sequence = mesh.shape["model"], mesh.shape["sequence"]
  assert plan["params"] == weight_bytes(TARGET, model)
  assert plan["caches"]["target full cache"] == kv_bytes(TARGET, plan["slots"], model, sequence) + 4
  _, decode = decode_loop_for_a_tpu("triforce", MESHES[-1])   # the same program as plan()'s
  assert {p["name"]: p for p in plan["programs"]}["decode loop"]["arguments"] == decode.arguments
  assert plan["peak"] == max(p["peak"] for p in plan["programs"]) > decode.arguments


@pytest.mark.slow
def test_plan_memory_for_a_tpu_slice_says_whose_figures_they_are(tmp_path):
  """The launcher compiles for --topology with the TPU compiler and says so in its record."""
  config = tmp_path / "tiny.py"
  config.write_text(TINY_SHAPES)
  proc = subprocess.run([sys.executable, "-m", "launch.plan_memory", f"--shapes={config}",
                         "--topology=v5e:2x2", "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert record["compiler"] == "tpu" and record["devices"] == 4 and record["mesh"] == "model:4"
  assert record["device"] == "v5e" and record["device_gib"] == 16 and record["fits"] is True
  assert "TPU v5 lite x 4 (the TPU compiler's figures)" in proc.stdout
  assert np.isclose(record["spare"], 1 - record["peak"] / (16 * 2**30))


def test_bad_topologies_are_named():
  for name in ("v5e", "tpu:2x2", "v5e:2by2"):
    with pytest.raises(ValueError, match=f"--topology='{name}'"):
      topology.devices(name)
  with pytest.raises(ValueError, match="--topology=v5e:3x3"):
    topology.devices("v5e:3x3")
  with pytest.raises(ValueError, match="--mesh=model:8 needs 8 devices; --topology=v5e:2x2 has 4"):
    topology.mesh("v5e:2x2", "model:8")
  assert topology.chips_of("v5e:2x4") == [2, 4] and topology.chip_kind("v6e:2x4") == "v6e"
