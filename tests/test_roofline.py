"""Each level's cost on paper: the bytes a TPU program moves to and from HBM (hbm_traffic.py),
each level's forward compiled by the TPU compiler for a v5e slice (roofline.py), and the
launchers that report them (level_cost --topology) and plan with them (plan --topology).

The model is tiny but its caches are long (test_tpu_compile's shapes), so that what a forward
must read is the cache, as at long context."""

import importlib.metadata
import json
import math
import subprocess
import sys

import jax
import pytest


from hitree_jax import hbm_traffic, roofline, sharding, stacks, topology
from hitree_jax.decode.sizes import decode_shapes
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from tests.helpers import DRAFT, REPO, TARGET, TINY_SHAPES, kv_bytes  # test_tpu_compile's model

CONTEXT = 16384
WIDTHS = (1, 8)

# A program as the TPU compiler writes it after memory-space assignment: S(1) is VMEM, no S(n) HBM.
PROGRAM = """HloModule m, is_scheduled=true

%row (param_0: bf16[1000,64], param_1: s32[]) -> bf16[1,64] {
  %param_0 = bf16[1000,64]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  ROOT %slice = bf16[1,64]{1,0:T(8,128)(2,1)} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,64}
}

%product (param_0: bf16[1,64], param_1: bf16[64,64]) -> bf16[1,64] {
  %param_0 = bf16[1,64]{1,0} parameter(0)
  %param_1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot = bf16[1,64]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[64,64], table: bf16[1000,64], i: s32[]) -> bf16[1,64] {
  %w = bf16[64,64]{1,0:T(8,128)(2,1)} parameter(0)
  %table = bf16[1000,64]{1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %copy-start = (bf16[64,64]{1,0:T(8,128)(2,1)S(1)}, bf16[64,64]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %copy-done = bf16[64,64]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %embedded = bf16[1,64]{1,0:T(8,128)(2,1)S(1)} fusion(%table, %i), kind=kLoop, calls=%row
  ROOT %out = bf16[1,64]{1,0:T(8,128)(2,1)} fusion(%embedded, %copy-done), kind=kOutput, calls=%product
}
"""


def test_hbm_traffic_counts_a_prefetched_weight_once_and_a_looked_up_row_alone():
  weight, row, index = 64 * 64 * 2, 64 * 2, 4
  # the weight copied into VMEM (read once; its product reads VMEM), the table's one row and the
  # index read by the lookup (its result stays in VMEM), the product's result written to HBM
  assert hbm_traffic.hbm_bytes(PROGRAM) == weight + (row + index) + row
  # the same program with the weight left in HBM: the product reads it there instead
  in_hbm = PROGRAM.replace("(2,1)S(1)} copy-done", "(2,1)} copy-done")
  assert hbm_traffic.hbm_bytes(in_hbm) == weight + (row + index) + weight + row


@pytest.fixture(scope="module")
def levels():
  mesh = sharding.make_mesh("model:4", topology.devices("v5e:2x2"))
  return roofline.Levels(TARGET, DRAFT, mesh, roofline.Chip.of(mesh.devices.flat[0]))


def check(costs, ideal: int, chip: roofline.Chip, fixed: int = 0):
  """fixed: bytes a forward moves whatever its cache (logits, the recent cache, activations),
  which only a tiny level notices."""
  for cost in costs:
    # what the TPU compiler's program moves is what the level must read, within 1.2x ...
    assert cost.ideal_bytes == ideal
    assert 0.98 * ideal <= cost.hbm_bytes <= 1.2 * ideal + fixed, (cost.level, cost.width, cost.over_ideal)
    # ... while its own analysis counts VMEM copies too
    assert cost.compiler_bytes > cost.hbm_bytes
    assert math.isclose(cost.seconds, max(cost.hbm_bytes / (chip.bandwidth_gb_s * 1e9),
                                          cost.flops / (chip.peak_tflops * 1e12)))
  assert [c.width for c in costs] == list(WIDTHS) and costs[0].flops < costs[1].flops


@pytest.mark.slow
def test_each_levels_forward_on_a_v5e_reads_its_weights_and_its_own_cache_once(levels):
  chip = levels.chip
  assert (chip.kind, chip.bandwidth_gb_s, chip.peak_tflops) == ("TPU v5 lite", 819, 197)
  target_weights = roofline.weights_read(levels.params, TARGET)
  full = kv_bytes(TARGET, CONTEXT, heads_split=4)
  check(levels.target_full(CONTEXT, WIDTHS), target_weights + full, chip)
  # the retrieval level reads its 256 + 48 slots, none of the full cache it was chosen from
  retrieval = levels.retrieval(CONTEXT, 256, 8, 48, WIDTHS)
  check(retrieval, target_weights + kv_bytes(TARGET, 256 + 48, heads_split=4), chip)
  assert all(c.hbm_bytes < full / 4 for c in retrieval)
  draft_weights = roofline.weights_read(levels.draft_params, DRAFT)
  check(levels.draft_streaming(CONTEXT, 4, 60, WIDTHS), draft_weights + kv_bytes(DRAFT, 64), chip, fixed=2**16)
  eagle = levels.eagle(CONTEXT, WIDTHS)
  layer = TARGET.replace(num_layers=1)
  # its cache (split by KV head over model:4, as its weights are: it has the target's heads) and weights
  assert eagle[0].ideal_bytes > kv_bytes(layer, CONTEXT, heads_split=4)
  check(eagle, eagle[0].ideal_bytes, chip)


def published_drafts(folder) -> dict[str, str]:
  """Config-only folders (no weights: a draft is costed before it is downloaded) of an EAGLE-3
  draft, over a vocabulary of 128 of the target's 256 ids, and a DFlash draft with a block of 4,
  for tests/helpers.py's TARGET -> {kind: path}."""
  shape = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, torch_dtype="bfloat16")
  configs = {"eagle3": dict(shape, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=128),
             "dflash": dict(shape, architectures=["DFlashDraftModel"], model_type="qwen3", head_dim=8, block_size=4,
                            dflash_config=dict(mask_token_id=255, target_layer_ids=[0, 1]))}
  paths = {}
  for kind, config in configs.items():
    (folder / kind).mkdir()
    (folder / kind / "config.json").write_text(json.dumps(config))
    paths[kind] = str(folder / kind)
  return paths


@pytest.mark.slow
def test_a_published_drafters_round_reads_its_weights_and_its_cache(levels, tmp_path):
  """draft_round compiles the drafter's own proposal of a round: it must read the draft's weights
  and its own cache of the context, a quarter of each on each device of model:4 (the engine splits
  a draft the mesh divides by head, MLP width and vocabulary; fc and the norms stay whole), and
  the verification is the target's forward of the round's pending tokens and nodes."""
  split = {"q", "k", "v", "o", "gate", "up", "down", "lm_head", "head"}
  share = lambda path, x: x.size * x.dtype.itemsize // (4 if getattr(path[-1], "key", None) in split else 1)
  drafts = published_drafts(tmp_path)
  layer = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
                      num_kv_heads=4, head_dim=8, max_position_embeddings=4096)
  for levels_text, nodes in ((f"eagle3:{drafts['eagle3']}/dynamic:8,4", 8), (f"dflash:{drafts['dflash']}/chain:3", 3)):
    stack = stacks.build(levels_text, TARGET)
    cost = levels.draft_round(stack, CONTEXT)
    slots = decode_shapes(stack, TARGET, CONTEXT, 1).slots   # the engine's cache of that prompt
    weights = sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(share, stack.drafter.abstract_heads(TARGET))))
    assert cost.ideal_bytes == weights + kv_bytes(layer, slots, heads_split=4), levels_text
    assert cost.width == nodes and cost.hbm_bytes >= 0.98 * cost.ideal_bytes and cost.flops > 0
    # the target verifies its root and the nodes: one token pending in a two-level stack
    assert levels.verify_width(stack) == 1 + nodes


def test_acceptance_lengths_need_a_source_and_taus_of_at_least_one(tmp_path):
  from hitree_jax.planner import on_paper
  path = tmp_path / "tau.json"
  for data, error in (({"acceptance_length": {"MT-bench": 3.1}}, "say where the figures come from"),
                      ({"source": "a paper", "acceptance_length": {"MT-bench": 0.5}}, "MT-bench: 0.5 is not a mean"),
                      ({"source": "a paper", "acceptance_length": {}}, "expected \"acceptance_length\"")):
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=error):
      on_paper.load_acceptance_length(str(path))
  with pytest.raises(UsageError, match="no such file"):
    on_paper.load_acceptance_length(str(tmp_path / "missing.json"))


def run(*args):
  proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
  return proc, (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None)


@pytest.mark.slow
def test_level_cost_and_plan_on_paper_for_a_v5e_slice(tmp_path):
  """level_cost --topology reports each level's roofline, labelled so; plan --topology predicts
  stacks from those costs and an acceptance file, and refuses a file without a source."""
  config = tmp_path / "tiny.py"
  config.write_text(TINY_SHAPES)
  proc, record = run("launch.level_cost", f"--shapes={config}", "--topology=v5e:2x2", "--prompt_tokens=1024",
                     "--widths=1,4", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert record["source"] == "roofline from the TPU compiler's cost analysis, not measured"
  assert record["device_kind"] == "TPU v5 lite" and record["mesh"] == "model:4"
  assert [r["level"] for r in record["rows"]] == ["target", "retrieval:256", "draft@streaming:4x60", "eagle"]
  assert all(len(r["costs"]) == 2 and r["costs"][0]["seconds"] > 0 for r in record["rows"])
  assert "| target | 1024 | 1 |" in proc.stdout

  acceptance = tmp_path / "acceptance.json"
  acceptance.write_text(json.dumps({"source": "a test", "acceptance": {
      "target<-retrieval:256": 0.9, "retrieval:256<-draft@streaming:4x60": 0.6}}))
  triforce = "draft@streaming:4x60/chain:1+retrieval:256/4"
  proc, record = run("launch.plan", "--topology=v5e:2x2", f"--shapes={config}", f"--acceptance={acceptance}",
                     f"--predict={triforce}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  stacks = {s["levels"]: s for s in record["stacks"]}
  assert stacks["ar"]["speedup"] == 1.0 and record["acceptance_source"] == "a test"
  assert 1 < stacks[triforce]["tokens_per_target_forward"] <= 5
  assert record["chosen"] in stacks and "not measured" in record["source"]

  acceptance.write_text(json.dumps({"acceptance": {"target<-retrieval:256": 0.9}}))
  proc, _ = run("launch.plan", "--topology=v5e:2x2", f"--shapes={config}", f"--acceptance={acceptance}")
  assert proc.returncode == 2 and f"--acceptance={acceptance}: say where the figures come from" in proc.stderr

  # a round of a stack with a published draft, and its speedup predicted from acceptance lengths
  dflash = published_drafts(tmp_path)["dflash"]
  with_levels = tmp_path / "tiny_dflash.py"
  with_levels.write_text(TINY_SHAPES.replace("batch=1,", f"batch=1, levels='dflash:{dflash}/chain:3',"))
  taus = tmp_path / "tau.json"
  taus.write_text(json.dumps({"source": "a test", "acceptance_length": {"chat": 2.5, "code": 3.5}}))
  proc, record = run("launch.level_cost", f"--shapes={with_levels}", "--topology=v5e:2x2", "--prompt_tokens=1024",
                     f"--acceptance_length={taus}", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert record["drafter"] == "dflash:4" and record["verify_width"] == 4 and record["source"].endswith("not measured")
  assert record["libtpu"] == importlib.metadata.version("libtpu") and record["command"].startswith("python -m launch.level_cost")
  (row,) = record["rows"]
  assert row["verify"]["width"] == 4 and row["ar"]["width"] == 1 and row["draft"]["width"] == 3
  for name, tau in (("chat", 2.5), ("code", 3.5)):
    expected = tau * row["ar"]["seconds"] / (row["verify"]["seconds"] + row["draft"]["seconds"])
    assert math.isclose(row["predicted"][name], expected)
  assert f"| 1024 | code | 3.5 | {row['predicted']['code']:.2f}x |" in proc.stdout
  assert math.isclose(row["break_even_tau"], row["round_seconds"] / row["ar"]["seconds"]) and row["break_even_tau"] > 1
  # taus measured with another stack are not applied to this one
  taus.write_text(json.dumps({"source": "a test", "stack": f"dflash:{dflash}/chain:2", "acceptance_length": {"chat": 2.5}}))
  proc, _ = run("launch.level_cost", f"--shapes={with_levels}", "--topology=v5e:2x2", "--prompt_tokens=1024",
                f"--acceptance_length={taus}")
  assert proc.returncode == 2 and f"its taus are for dflash:{dflash}/chain:2, not the config's" in proc.stderr
