"""Sharded decoding on 8 simulated CPU devices (conftest): the same greedy tokens as one device for
every kind of stack, each array where it was declared, the retrieval selection of a cache split by
slots equal to one device's, no recompiles, and clear refusals of meshes that do not fit."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax import memory_plan, sharding
from hitree_jax.cache import retrieval
from hitree_jax.cache.full import KVCache
from hitree_jax.cache.streaming import StreamingCache
from hitree_jax.decode import engine, long_caches, loop, retrieve, sizes
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.drafters import DraftWeights, ModelDrafter, NGramDrafter
from hitree_jax.decode.programs import Programs
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree import shapes as tree_lib
from tests.helpers import peaked  # random weights without greedy near-ties

# 8 query heads over 4 KV heads: model:4 puts one KV head on each device.
CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=8,
                     num_kv_heads=4, head_dim=8, max_position_embeddings=512, eos_token_id=None)
DRAFT = CONFIG.replace(num_layers=1, num_heads=2, num_kv_heads=1)  # replicated: its heads do not split
PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 3, 5, 7, 2, 9, 4, 6, 1, 8, 3, 5, 7, 11] * 3, [2, 4]]  # ragged
STACKS = {
    "ar": None,
    "tree": Stack(ModelDrafter(DRAFT), tree_lib.kary(2, 2)),
    "triforce": Stack(ModelDrafter(DRAFT, cache=Streaming(4, 8)), tree_lib.chain(1),
                      (Verifier("target", Retrieval(16, 4), 6),)),
    "4-level": Stack(NGramDrafter(2), tree_lib.chain(2),
                     (Verifier("draft", Full(), 3), Verifier("target", Retrieval(16, 4, reselect=8), 5)),
                     draft=DRAFT),
}
MESHES = ("data:2,model:4", "sequence:2,model:4")
from tests.helpers import REPO
from tests.helpers import TINY_SHAPES
DRAFT_FILE = "drafts/smollm2-draft.gguf"


def with_devices(devices: int) -> dict:
  """This environment, for a process that simulates `devices` CPU devices (keeping conftest's
  XLA flags)."""
  return dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                    f"--xla_force_host_platform_device_count={devices}".strip())


@pytest.fixture(scope="module")
def params():
  return peaked(CONFIG, 0)


@pytest.fixture(scope="module")
def draft():
  return DraftWeights.create(peaked(DRAFT, 1))


@pytest.fixture(scope="module")
def one_device(params, draft):
  return {name: engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=draft, max_new_tokens=30).tokens
          for name, stack in STACKS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("name", list(STACKS))
def test_sharded_greedy_equals_one_device(params, draft, one_device, name, mesh_spec):
  mesh = sharding.make_mesh(mesh_spec)
  result = engine.generate(params, CONFIG, PROMPTS, stack=STACKS[name], draft=draft, max_new_tokens=30,
                           mesh=mesh)
  assert result.tokens == one_device[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tree", "triforce"])
def test_sharded_sampling_draws_what_one_device_draws(params, draft, one_device, name):
  """Sampling under a mesh is the same computation: with the same seed it draws the same tokens
  as one device (jax's random bits do not depend on how an array is split), so its law is the
  one the enumeration tests (test_engine, test_hierarchy) check on one device."""
  sampling = SamplingParams.create(0.8, 0.9)
  run = lambda mesh: engine.generate(params, CONFIG, PROMPTS, stack=STACKS[name], draft=draft,
                                     max_new_tokens=30, sampling=sampling, seed=5, mesh=mesh).tokens
  expected = run(None)
  assert expected != one_device[name]   # it did sample (the greedy tokens differ)
  assert run(sharding.make_mesh("data:2,model:4")) == expected


@pytest.mark.slow
def test_prefill_over_a_cache_split_by_slot_is_exact_and_gathers_nothing(params, draft):
  """A 1,100-token prompt prefills in 3 chunks; under sequence:2 each device reads only its own
  slots of the cache (a per-shard loop, softmax states merged across devices): the tokens are one
  device's, and the prefill's temporaries are far below the cache that gathering would copy."""
  config = CONFIG.replace(max_position_embeddings=2048)
  prompt = [list(np.random.default_rng(1).integers(0, 64, 1100)), PROMPTS[1]]
  stack = STACKS["triforce"]
  one = engine.generate(params, config, prompt, stack=stack, draft=draft, max_new_tokens=16)
  split = engine.generate(params, config, prompt, stack=stack, draft=draft, max_new_tokens=16,
                          mesh=sharding.make_mesh("sequence:2,model:4"))
  assert split.tokens == one.tokens
  # At 30K tokens, the prefill's temporaries with the slots split are those without (model:4):
  # gathering the cache would add at least the whole cache's share of every device.
  config = CONFIG.replace(max_position_embeddings=32768)
  plans = [memory_plan.plan(config, DRAFT, lambda _: stack, sharding.make_mesh(mesh), prompt_tokens=30000,
                            max_new_tokens=16, batch=1) for mesh in ("sequence:2,model:4", "model:4")]
  split_plan, heads_plan = ({p["name"]: p for p in plan["programs"]} for plan in plans)
  cache = plans[1]["caches"]["target full cache"]                  # per device, slots not split
  assert plans[0]["caches"]["target full cache"] == cache // 2 + 2  # + the lengths, per row
  assert split_plan["prefill chunk"]["temporaries"] < heads_plan["prefill chunk"]["temporaries"] + cache // 4


@pytest.mark.slow
def test_a_second_sharded_generation_compiles_nothing(params, draft):
  mesh, programs = sharding.make_mesh("data:2,model:4"), Programs()
  run = lambda: engine.generate(params, CONFIG, PROMPTS, stack=STACKS["triforce"], draft=draft,
                                max_new_tokens=12, mesh=mesh, programs=programs)
  first = run()
  assert first.compiles + first.cache_loads > 0
  again = run()
  assert again.compiles == again.cache_loads == 0
  # The same shapes on one device are other programs, not a stale sharded one.
  one = engine.generate(params, CONFIG, PROMPTS, stack=STACKS["triforce"], draft=draft,
                        max_new_tokens=12, programs=programs)
  assert one.compiles + one.cache_loads > 0


def expect(array, mesh, mesh_axes):
  want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*mesh_axes))
  assert array.sharding.is_equivalent_to(want, array.ndim), (array.sharding, want)


@pytest.mark.slow
def test_every_array_is_where_it_was_declared(params, draft):
  """Params split by role; after prefill and after the whole decode loop (which donates them),
  each level's long cache keeps its declared sharding: the target's full cache by row, KV head
  and slot, its retrieval cache by row and KV head, the draft's full cache by row and slot."""
  mesh = sharding.make_mesh("data:2,sequence:2,model:2")
  stack_sizes = sizes.StackSizes(STACKS["4-level"], CONFIG, DRAFT, mesh)
  batch = prefill_lib.make_batch(PROMPTS, CONFIG, 30)
  weights = loop.Weights(sharding.place_params(params, mesh), sharding.replicate(draft, mesh))
  expect(weights.target["layers_0"]["self_attn"]["q_proj"]["kernel"], mesh, (None, "model"))
  expect(weights.target["layers_0"]["self_attn"]["o_proj"]["kernel"], mesh, ("model", None))
  expect(weights.target["layers_1"]["mlp"]["down_proj"]["kernel"], mesh, ("model", None))
  expect(weights.target["embed_tokens"]["embedding"], mesh, ("model", None))
  expect(weights.draft.params["layers_0"]["mlp"]["up_proj"]["kernel"], mesh, (None, None))

  programs = Programs()
  full = stack_sizes.levels[-1].place_long(KVCache.init(CONFIG, batch.batch, 512), mesh)
  _, prefilled = prefill_lib.prefill(weights.target, CONFIG, full, batch, programs)
  expect(prefilled.keys[0], mesh, ("data", "model", None, "sequence"))  # the prefill program kept it

  first, longs = long_caches.prefill_levels(stack_sizes, weights, CONFIG, batch, 512, 64, programs)
  seq = np.zeros((batch.batch, 512), np.int32)
  seq[:, :batch.tokens.shape[1]] = batch.tokens
  start = loop.DecodeStart(first, SamplingParams.create(), jnp.int32(-1), jax.random.key(0), jnp.asarray(seq),
                           jnp.asarray(batch.lengths))
  out, _, _, after = engine.decode(engine.Prefilled(stack_sizes, weights, longs, start, 30), programs)
  declared = {1: ("data", None, None, "sequence"), 2: ("data", "model", None, None),
              3: ("data", "model", None, "sequence")}               # keys, values [B, KVH, D, S]
  for caches in (longs, after):
    assert caches[0] is None                                        # the n-gram drafter keeps none
    for j, axes in declared.items():
      expect(caches[j].values[0], mesh, axes)
      expect(caches[j].keys[-1], mesh, axes)
      expect(caches[j].lengths, mesh, ("data",))
  expect(out, mesh, ("data", None))


def test_top_k_by_shards_equals_one_top_k():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(0, 6, size=(3, 2, 64)).astype(np.float32))   # many ties
  x = x.at[0, 0, 10:40].set(-jnp.inf)
  for shards in (2, 4, 8):
    for k in (1, 5, 8, 13):
      np.testing.assert_array_equal(retrieval.top_k_indices(x, k, shards), jax.lax.top_k(x, k)[1])


def test_retrieval_selection_of_a_cache_split_by_slots(params):
  """Chunks chosen from a full cache split over 4 slot shards (a top-k per shard, then of their
  winners) are one device's choice; so are the kept keys."""
  batch = prefill_lib.make_batch([list(np.arange(200) % 61), list(np.arange(90) % 7)], CONFIG, 8)
  last = jnp.asarray(batch.tokens[np.arange(2), batch.lengths - 1])

  def select(mesh):
    full = sharding.place_cache(KVCache.init(CONFIG, 2, 256), mesh)
    _, full = prefill_lib.prefill(sharding.place_params(params, mesh), CONFIG, full, batch, Programs())
    shards = sharding.sequence_shards(mesh)
    return jax.jit(retrieve.from_full, static_argnums=(1, 4, 5, 6, 7))(
        sharding.place_params(params, mesh), CONFIG, full, last, 64, 4, 0, shards)

  one, split = select(None), select(sharding.make_mesh("sequence:4,model:2"))
  np.testing.assert_array_equal(split.chunks, one.chunks)
  assert not np.array_equal(one.chunks[:, 0], np.broadcast_to(np.arange(16), one.chunks[:, 0].shape))
  np.testing.assert_allclose(split.keys[1], one.keys[1], atol=1e-4)  # model:2 sums in another order
  np.testing.assert_array_equal(split.lengths, one.lengths)


def bytes_per_device(tree) -> int:
  """What the most loaded device really holds of tree's arrays."""
  held = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values())


@pytest.mark.slow
def test_memory_plan_counts_what_the_arrays_hold(params, draft):
  """The plan's per-device bytes, computed from abstract arrays, are what the placed weights and
  the prefilled caches of a real generation hold; its decode program's arguments are those."""
  mesh, stack = sharding.make_mesh("data:2,model:4"), STACKS["triforce"]
  plan = memory_plan.plan(CONFIG, DRAFT, lambda _: stack, mesh, prompt_tokens=60, max_new_tokens=8, batch=2)
  stack_sizes = sizes.StackSizes(stack, CONFIG, DRAFT, mesh)
  batch = prefill_lib.make_batch(PROMPTS, CONFIG, 8)
  weights = loop.Weights(sharding.place_params(params, mesh), sharding.replicate(draft, mesh))
  slots = prefill_lib.cache_slots(60, 8, extra=stack_sizes.recent_slots)
  first, longs = long_caches.prefill_levels(stack_sizes, weights, CONFIG, batch, slots,
                                            prefill_lib.round_up(8 + stack_sizes.recent_slots, 8), Programs())
  assert plan["slots"] == slots
  assert plan["params"] == bytes_per_device(weights.target) > 0
  assert plan["draft_params"] == bytes_per_device(weights.draft.params)
  assert plan["caches"] == {"draft streaming cache": bytes_per_device(longs[0]),
                            "level 1 retrieval cache": bytes_per_device(longs[1]),
                            "target full cache": bytes_per_device(longs[2]),
                            "draft full cache (prefill only)": bytes_per_device(sharding.place_cache(
                                KVCache.init(DRAFT, 2, slots), mesh, heads=False))}
  decode = plan["programs"][-1]
  assert decode["name"] == "decode loop"
  held = bytes_per_device((weights, longs, first[0]))
  assert held <= decode["arguments"] <= held + 64 * 1024   # + the token buffer, the key, the settings
  assert decode["aliased"] >= bytes_per_device(longs)        # the caches are updated in place
  assert plan["peak"] == max(p["peak"] for p in plan["programs"])


@pytest.mark.slow
def test_plan_memory_launcher_says_whether_it_fits(tmp_path):
  """TriForce's stack of a shapes config, and a stack of levels with a published DFlash draft of
  which only config.json exists (its shapes: a draft is planned before it is downloaded)."""
  config = tmp_path / "tiny.py"
  config.write_text(TINY_SHAPES)
  dflash = tmp_path / "dflash"
  dflash.mkdir()
  (dflash / "config.json").write_text(json.dumps(dict(
      architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=256, hidden_size=64,
      intermediate_size=128, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
      max_position_embeddings=4096, block_size=4, dflash_config=dict(mask_token_id=255, target_layer_ids=[0, 1]))))
  with_levels = tmp_path / "tiny_dflash.py"
  with_levels.write_text(TINY_SHAPES.replace("batch=1,", f"batch=1, levels='dflash:{dflash}/chain:3',"))
  for shapes, device, fits in ((config, "h100", True), (with_levels, "0.001", False)):
    proc = subprocess.run([sys.executable, "-m", "launch.plan_memory", f"--shapes={shapes}", "--mesh=model:4",
                           f"--device={device}", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["fits"] is fits and record["devices"] == 4 and record["mesh"] == "model:4"
    assert record["compiler"] == "cpu-simulated" and "an estimate" in proc.stdout  # no --topology
    assert ("does NOT fit" in proc.stdout) is not fits
    # bfloat16: the temporaries counted are at most XLA:CPU's own (which widens to float32)
    assert all(p["temporaries"] <= p["temporaries_cpu"] for p in record["programs"])
    # where it came from
    assert record["command"] == f"python -m launch.plan_memory --shapes={shapes} --mesh=model:4 --device={device} --json"
    assert record["jax"] == jax.__version__ and record["cpu"] and record["libtpu"] is None
  assert record["levels"] == f"dflash:{dflash}/chain:3" and "dflash full cache" in record["caches"]
  assert record["draft_params"] > 0


def tiny_shapes_bytes(slots: int, model: int) -> tuple[int, int, int]:
  """By hand, for TINY_SHAPES in bfloat16, the target split model-ways by head, per device: (the
  target's weights a step reads, without its embedding table; what level_cost holds at a context
  of `slots`: both models' weights, the target's full caches of `slots` and of the retrieval
  budget, and the draft's full cache; the draft, of the target's heads, split as the target is)."""
  e, f, h, kvh, d, v = 64, 128, 8, 4, 8, 256
  layer = lambda split: 2 * ((e * h * d * 2 + 2 * e * kvh * d + 3 * e * f) // split + 2 * e)  # + 2 norms
  read = 2 * layer(model) + 2 * (e * v // model + e)                     # 2 layers, the head, the final norm
  cache = lambda layers, heads, n: layers * 2 * 2 * heads * d * n + 4    # keys + values, + the lengths
  draft = layer(model) + 2 * (2 * e * v // model + e)                    # 1 layer, embedding, head, norm
  held = (read + 2 * e * v // model + draft + cache(2, kvh // model, slots) + cache(2, kvh // model, 256)
          + cache(1, kvh // model, slots))
  return read, held, cache(2, kvh // model, slots)


@pytest.mark.slow
def test_level_cost_times_every_level_against_the_floor_and_skips_what_does_not_fit(tmp_path):
  """launch.level_cost on a mesh of 4: each level's forward at two contexts, `ar`'s step against
  the floor of the bytes it reads per device (counted here by hand), and a context whose arrays
  need more than the memory given skipped, saying so."""
  config = tmp_path / "tiny.py"
  config.write_text(TINY_SHAPES)
  weights, held_512, full_512 = tiny_shapes_bytes(512, model=4)
  env = with_devices(4)
  proc = subprocess.run([sys.executable, "-m", "launch.level_cost", f"--shapes={config}", "--mesh=model:4",
                         "--prompt_tokens=512,1024", "--widths=1,3", "--repeats=2", "--bandwidth_gb_s=10",
                         "--memory_gib=0.00018", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert record["devices"] == 4 and record["mesh"] == "model:4" and record["weights_read_bytes"] == weights
  assert "--prompt_tokens=512,1024" in record["command"] and record["jax"] and record["cpu"]   # its provenance
  fits, too_big = record["rows"]
  assert fits["context"] == 512 and fits["floor_ms"] == pytest.approx(1e3 * (weights + full_512) / 10e9)
  for level in ("target_ms", "attention_ms", "retrieval_ms", "draft_ms"):
    assert set(fits[level]) == {"1", "3"} and min(fits[level].values()) > 0
  assert fits["ar_over_floor"] == pytest.approx(fits["target_ms"]["1"] / fits["floor_ms"])
  assert fits["select_ms"] > 0 and set(record["baseline_ms"]) == {"1", "3"}
  assert fits["bytes_per_device"] == held_512 and too_big["bytes_per_device"] == tiny_shapes_bytes(1024, 4)[1]
  assert held_512 < 0.92 * 0.00018 * 2**30 < too_big["bytes_per_device"]
  assert too_big["context"] == 1024 and "needs" in too_big["skipped"] and "target_ms" not in too_big
  assert "| 1024 | skipped: needs" in proc.stdout
  assert "context 512, target: 1 tok" in proc.stdout   # each level said as it is timed
  proc = subprocess.run([sys.executable, "-m", "launch.level_cost", f"--shapes={config}", "--prompt_tokens=256"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "must exceed the retrieval budget (256)" in proc.stderr
  proc = subprocess.run([sys.executable, "-m", "launch.level_cost", f"--shapes={config}", "--prompt_tokens=4090",
                         "--widths=1,8"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "4090 + 8 tokens is past the target's 4096 positions" in proc.stderr


def test_level_cost_times_caches_of_the_engines_shape():
  """level_cost's cache for a context holds that many tokens in the slots the engine allocates
  (the bucket's multiple): the shape decides the GPU's kernels (an H200 padded a 131,008-slot
  cache every step, at 2.5x the time of a 131,072-slot one). In a process of its own: importing a
  launcher defines its flags, which other launchers the tests import define too (--mesh)."""
  code = ("from launch import level_cost; from tests.test_sharding import CONFIG; "
          "cache = level_cost.Arrays(CONFIG, None).cache(600, seed=0); "
          "print(cache.keys[0].shape[-1], cache.lengths.tolist(), level_cost.engine_slots(768))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert prefill_lib.cache_slots(600, 0) == 768
  assert proc.stdout.split() == ["768", "[600]", "768"]


@pytest.mark.parametrize("spec, message", [
    ("model:3", "model:3 does not divide the target's 8 query heads"),
    ("data:4", "data:4 does not divide the batch of 2 prompts"),
    ("model:16", "needs 16 devices; this machine has 8"),
])
def test_meshes_that_do_not_fit_are_refused(params, spec, message):
  with pytest.raises(ValueError, match=message):
    engine.generate(params, CONFIG, PROMPTS, max_new_tokens=4, mesh=sharding.make_mesh(spec))


@pytest.mark.parametrize("spec, message", [
    ("model=4", "expected AXIS:N"), ("tensor:2", "not one of"), ("model:2,model:2", "twice"),
    ("model:0", ">= 1")])
def test_bad_mesh_specs_are_named(spec, message):
  with pytest.raises(ValueError, match=message):
    sharding.parse_mesh(spec)


# SmolLM2 (9 query heads, 3 KV heads) through the launcher, as a user runs it: split 3 ways by
# head, and 2 ways by cache slot. Its greedy tokens are the single-device ones.
SMOLLM2 = ["--model=smollm2", "--text=austen", "--prompt_tokens=300", "--max_new_tokens=10",
           "--ignore_eos", "--json"]


def launch_generate(*args, devices: int = 1, wait: bool = True, model: list[str] = SMOLLM2):
  # LLVM's -O1, not conftest's -O0: the real model's decoding over 8 simulated devices on 2 cores
  # is dominated by running at -O0 (hitree split by slot: 600 s, against 104 s at XLA's default
  # -O2). At -O1 it decodes as fast as at -O2 and compiles faster: 60 s against 72 s alone.
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                   "--xla_backend_optimization_level=1")
  proc = subprocess.Popen([sys.executable, "-m", "launch.generate", *model, *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return finish(proc) if wait else proc


def finish(proc) -> dict:
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def smollm2_one_device():
  return launch_generate()["tokens"]


@pytest.mark.slow
def test_smollm2_sharded_equals_one_device(smollm2_one_device):
  """HiTree with the target split 3 ways by head and 2 by slot, in one process of 8 devices (`ar`
  over the same mesh: the next test, over two processes)."""
  record = launch_generate("--mesh=sequence:2,model:3", "--method=hitree", f"--draft={DRAFT_FILE}", "--budget=128",
                           devices=8)
  assert record["tokens"] == smollm2_one_device
  assert record["mesh"] == "sequence:2,model:3"


@pytest.mark.slow
def test_over_two_processes_equals_one_device(tmp_path):
  """Over two processes (several hosts: jax.distributed, CPU collectives), each holding 3 of the 6
  devices of a mesh split 3 ways by head and 2 by slot, the launcher's greedy tokens are one
  device's. The model is a 2-layer random one with SmolLM2's tokenizer (6 query heads, 3 KV heads):
  what is tested is the processes' wiring, the same for any model; SmolLM2 over two processes
  compiled its 30 layers twice on two cores (74 s of the suite; suite_time.md, run 41)."""
  from tests.helpers import tiny_model_gguf
  model = [f"--model={tiny_model_gguf(tmp_path / 'tiny.gguf', num_layers=2, width=48, heads=(6, 3))}",
           *SMOLLM2[1:]]
  one_device = launch_generate(model=model)["tokens"]
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [launch_generate("--mesh=sequence:2,model:3", f"--coordinator_address=localhost:{port}",
                           "--num_processes=2", f"--process_id={i}", devices=3, wait=False, model=model)
           for i in range(2)]
  for proc in procs:
    assert finish(proc)["tokens"] == one_device


@pytest.mark.slow
def test_smollm2_mesh_that_does_not_divide_its_heads_is_refused():
  env = with_devices(2)
  proc = subprocess.run([sys.executable, "-m", "launch.generate", "--model=smollm2", "--prompt=Hi",
                         "--mesh=model:2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert "error: --mesh model:2 does not divide the target's 9 query heads" in proc.stderr


def test_cache_axes_are_declared_with_the_fields_and_an_undeclared_array_is_refused():
  """Each cache class declares its arrays' logical axes beside its fields (cache.full.axes_field);
  the level decides only whether its heads and slots are split. An array field that declares
  none is an error, not a silent replica."""
  import flax.struct
  full = KVCache.init(CONFIG, 2, 64)
  axes = sharding.cache_axes(full, heads=True, slots=False)
  assert axes.keys[0] == axes.values[-1] == ("batch", "kv_heads", "head_dim", None)
  assert axes.lengths == ("batch",)
  assert sharding.cache_axes(full).keys[0] == ("batch", "kv_heads", "head_dim", "sequence")
  streaming = sharding.cache_axes(StreamingCache.init(CONFIG, 2, 4, 8), heads=False, slots=False)
  assert streaming.keys[0] == ("batch", None, "head_dim", None) and streaming.seen == ("batch",)

  @flax.struct.dataclass
  class Tagged(KVCache):
    tags: jax.Array

  tagged = Tagged(full.keys, full.values, full.lengths, jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match=r"Tagged.tags \(shape \(2, 3\)\) declares no logical axes"):
    sharding.cache_axes(tagged)


@pytest.mark.slow
def test_a_model_with_attention_biases_shards_and_decodes_as_on_one_device():
  """Qwen2's q/k/v biases (and a biased Llama's o_proj one) split with their projections' heads."""
  from tests.helpers import with_random_biases
  biased = CONFIG.replace(qkv_bias=True, o_bias=True)
  params = with_random_biases(peaked(biased, 0))
  axes = sharding.param_axes(params)["layers_0"]["self_attn"]
  assert (axes["q_proj"]["bias"], axes["k_proj"]["bias"], axes["o_proj"]["bias"]) == (
      ("heads",), ("kv_heads",), ("embed",))
  one_device = engine.generate(params, biased, PROMPTS, max_new_tokens=12).tokens
  sharded = engine.generate(params, biased, PROMPTS, max_new_tokens=12,
                            mesh=sharding.make_mesh("data:2,model:4"))
  assert sharded.tokens == one_device


def test_every_parameter_has_declared_axes_and_an_undeclared_one_is_refused():
  """model/llama.py declares each parameter's logical axes beside its modules (PARAM_AXES)."""
  from hitree_jax.model.llama import init_params, with_decode_head
  tied = CONFIG.replace(tie_word_embeddings=True)
  params = with_decode_head(init_params(tied, jax.random.key(0)), tied)
  axes = sharding.param_axes(params)
  assert axes["layers_0"]["self_attn"]["k_proj"]["kernel"] == ("embed", "kv_heads")
  assert axes["norm"]["weight"] == ("embed",) and axes["lm_head"]["kernel"] == ("embed", "vocab")
  with pytest.raises(ValueError, match="parameter layers_0/adapter/kernel .* has no logical axes declared"):
    sharding.param_axes(dict(params, layers_0=dict(params["layers_0"], adapter={"kernel": jnp.zeros((4, 4))})))


# ---- drafts split like the target where the mesh divides them ----

SPLIT_DRAFT = CONFIG.replace(num_layers=1)   # 8 heads over 4 KV heads, as the target: model:4 splits it


def split_drafts(params):
  """{name: (stack, DraftWeights)}: a draft model, an EAGLE-3 draft and a DFlash draft whose heads,
  KV heads and MLP width model:4 divides (the feature drafts trained here, random weights)."""
  from hitree_jax.heads import eagle3
  from hitree_jax.heads.dflash import BlockSpec
  from hitree_jax.heads.drafter import DFlashDrafter, EagleDrafter
  from hitree_jax.model.vocab import ReducedVocab
  from hitree_jax.train import dflash as train_dflash, eagle3 as train_eagle3
  vocab = ReducedVocab(np.array([-1, *range(0, 62, 2)], np.int32), CONFIG.vocab_size)   # a head of 31: whole
  layer = train_eagle3.layer_config(CONFIG)
  eagle = train_eagle3.init_params(CONFIG, params, vocab, jax.random.key(1), aux=2, scale=0.3)
  eagle_drafter = EagleDrafter(layer.replace(vocab_size=vocab.size), "deterministic", CONFIG.vocab_size,
                               taps=(0, 1), net=eagle3.Eagle3Net(aux=2, eps=CONFIG.rms_norm_eps))
  block = train_dflash.layer_config(CONFIG, 1)
  dflash = dict(train_dflash.init_params(block, 2, jax.random.key(2), scale=0.3),
                head=params["embed_tokens"]["embedding"].T)   # the target's (tied) head
  truncated = {name: params[name] for name in ("embed_tokens", "layers_0", "norm", "lm_head")}   # the target's first layer
  return {"draft model": (Stack(ModelDrafter(SPLIT_DRAFT), tree_lib.kary(2, 2)), DraftWeights.create(truncated)),
          "eagle3": (Stack(eagle_drafter, tree_lib.DynamicTree(6, 3, 2)), DraftWeights.create(eagle, vocab)),
          "dflash": (Stack(DFlashDrafter(block, BlockSpec(4, 63, (0, 1))), tree_lib.kary(4, 2)),
                     DraftWeights.create(dflash))}


@pytest.mark.slow
def test_a_draft_the_mesh_divides_is_split_and_decodes_as_on_one_device(params):
  """Draft weights are read by every round: split by head, MLP width and vocabulary over `model`
  (as the target's are) where the mesh divides them, each device reads its share. Each axis that
  does not divide (a reduced vocabulary with its OTHER slot) stays whole; the tokens are one
  device's, for a draft model, an EAGLE-3 tree and a DFlash block."""
  mesh = sharding.make_mesh("data:2,model:4")
  for name, (stack, weights) in split_drafts(params).items():
    stack_sizes = sizes.StackSizes(stack, CONFIG, stack.draft_config, mesh)
    placed = sharding.place_draft(weights, stack_sizes.draft_weights_config, mesh)
    if name == "draft model":
      expect(placed.params["layers_0"]["self_attn"]["k_proj"]["kernel"], mesh, (None, "model"))
      expect(placed.params["lm_head"]["kernel"], mesh, (None, "model"))
    else:
      layer = placed.params["layers"][0]
      expect(layer["q"], mesh, (None, "model"))
      expect(layer["down"], mesh, ("model", None))
      expect(placed.params["fc"], mesh, (None, None))
      head = "lm_head" if name == "eagle3" else "head"
      expect(placed.params[head], mesh, (None, None) if name == "eagle3" else (None, "model"))
    assert all(level.splits_heads for level in stack_sizes.levels)   # its caches by KV head too
    one = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=weights, max_new_tokens=24)
    split = engine.generate(params, CONFIG, PROMPTS, stack=stack, draft=weights, max_new_tokens=24, mesh=mesh)
    assert split.tokens == one.tokens, name
    # the same proposals accepted: the split draft computes what the whole one does (and some are)
    assert split.accepted_per_depth == one.accepted_per_depth and sum(one.accepted_per_depth) > 0, name
  unsplit = sizes.StackSizes(STACKS["tree"], CONFIG, DRAFT, mesh)
  assert not unsplit.levels[0].splits_heads      # DRAFT's 2 heads: whole on every device
  placed = sharding.place_draft(DraftWeights.create(peaked(DRAFT, 1)), DRAFT, mesh)
  expect(placed.params["layers_0"]["self_attn"]["q_proj"]["kernel"], mesh, (None, None))
