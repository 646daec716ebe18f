"""What each level of a long-context hierarchy costs on the devices present, for a real-shaped target.

  python -m launch.level_cost --shapes=configs/llama2_7b_128k.py --prompt_tokens=32768,65536,130560 --json
  python -m launch.level_cost --shapes=configs/llama2_7b_128k.py --mesh=model:8 --prompt_tokens=130560

The config is a shapes config (configs/llama*_128k.py, as for launch.plan_memory): the target,
the draft, the retrieval budget and the StreamingLLM window. The weights and each context's
caches hold arbitrary numbers in the config's dtype (`noise`): a forward's time does not depend
on what they are. At each context length it times, as the median of --repeats calls of
FORWARDS_PER_CALL forwards in one program (planner/profile.py's timing):

  target            w tokens over the full cache of the context (w = 1 is `ar`'s step), and
                      `attention_ms`, one layer's attention to that cache alone, x the layers
  retrieval:B       the target over the retrieval cache of B slots chosen from that cache
                      (TriForce's middle level), and `select_ms`, what choosing them costs
  draft@streaming   the draft over a StreamingLLM cache (sinks + window) of the context

and, once, the target over a full cache of B tokens: the forward the retrieval level should
cost, whatever the context. `ar`'s step is set against the HBM floor, the bytes a step must
read (the weights and the cache's keys and values, per device) over the device's bandwidth
(memory_plan.DEVICE_BANDWIDTH_GB_S, or --bandwidth_gb_s). A context whose arrays do not fit the
device's memory is skipped, with a line saying what it needs. On a CPU it runs too (small
configs: the tests), without a floor unless --bandwidth_gb_s is given.

On paper, for a TPU you do not have (libtpu installed: ./setup.sh --tpu, or the test packages):

  python -m launch.level_cost --shapes=configs/llama2_7b_128k.py --topology=v5e:2x4 --json

compiles one forward of each level with the TPU compiler for that slice (hitree_jax/roofline.py)
and reports, per device, its flops, the bytes it moves to and from HBM, the bytes it must read
(weights and its cache), and the roofline time: the larger of bytes / the chip's bandwidth and
flops / its peak. Besides the levels above, it costs an EAGLE layer over its own cache of the
context. These figures are a roofline from the TPU compiler's program, not a measurement.

A round of a stack with a published feature drafter, on paper (a shapes config that names its
`levels`: configs/llama3_8b_eagle3.py, configs/qwen3_8b_dflash.py):

  python -m launch.level_cost --shapes=configs/llama3_8b_eagle3.py --topology=v5e:2x4 \
      --acceptance_length=configs/acceptance/eagle3_llama3.1_8b.json

costs `ar`'s step (the target's one-token forward), the target's verification of a round (its
pending tokens and the tree's nodes) and the drafter's whole proposal of a round (roofline.py's
`draft_round`), and the round over the step: the tokens a round must commit to match `ar`.
With --acceptance_length (published mean tokens per round, tau, with their source and the
stack they were measured with) it predicts each benchmark's speedup: tau x the `ar` step / (the
proposal + the verification). No per-round overheads (sampling, bookkeeping) are counted.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import pathlib
import time

from absl import flags
from ml_collections import config_flags

from hitree_jax.errors import UsageError
from . import common

config_flags.DEFINE_config_file("shapes", None, "A shapes config: configs/llama2_7b_128k.py, "
                                "configs/llama3_8b_128k.py (--shapes.budget=8192 overrides a field).")
common.define_mesh_flags()
flags.DEFINE_list("prompt_tokens", ["32768", "65536", "98304", "130560"], "Context lengths in tokens "
                  "(cache slots filled), smallest first; each must exceed the retrieval budget.")
flags.DEFINE_list("widths", ["1", "2", "4", "8"], "Tokens per forward.")
flags.DEFINE_integer("repeats", 10, "Timed calls per forward (the median is reported).")
flags.DEFINE_float("bandwidth_gb_s", None, "Memory bandwidth per device, GB/s (default: the "
                   "accelerator's, from memory_plan.DEVICE_BANDWIDTH_GB_S; none on a CPU).")
flags.DEFINE_float("memory_gib", None, "Memory per device to plan within, GiB (default: what the "
                   "device reports; no limit on a CPU).")
flags.DEFINE_string("topology", None, "A TPU slice (v5e:2x4, v6e:2x4, v5p:2x2x1, ...): cost each "
                    "level on paper, compiled by the TPU compiler without a TPU (a roofline, not "
                    "measured). Needs libtpu (pip install \"jax[tpu]\", ./setup.sh --tpu).")
flags.DEFINE_string("acceptance_length", None, "On paper, for a config that names its levels: a "
                    "JSON file of published mean tokens per round (tau) by benchmark, with its source "
                    "(configs/acceptance/eagle3_llama3.1_8b.json); predicts each one's speedup.")
flags.DEFINE_string("out", None, "Also write the JSON record here, and its table to OUT.md.")
flags.DEFINE_bool("json", False, "Print the JSON record as the last line.")
FLAGS = flags.FLAGS

HEADROOM = 0.92   # of a device's memory that the arrays may take: the rest is for temporaries


def retrieval_name(cfg) -> str:
  """TriForce's middle level as profiles name it: the target over a retrieval cache."""
  from hitree_jax.cache.kinds import Retrieval
  return str(Retrieval(cfg.budget))


def streaming_name(cfg) -> str:
  """TriForce's drafter as profiles name it: the draft over a StreamingLLM cache."""
  from hitree_jax.cache.kinds import Streaming
  from hitree_jax.decode import spec
  return str(spec.Level.of(spec.DraftModel(), Streaming(cfg.sinks, cfg.window)))


def noise(shape, dtype, seed: int, scale: float = 1.0):
  """Numbers in [-scale, scale) from a multiplicative hash of each element's index: one fusion per
  array, which the GPU compiler builds at once. XLA's random generators took the H200's compiler
  about 0.2 s per array (49-70 s for a 7B target's weights, threefry or rbg alike); a forward's
  time does not depend on what the numbers are."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  i = jax.lax.iota(jnp.uint32, math.prod(shape)) + np.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
  h = i * np.uint32(2654435761)
  h = (h ^ (h >> 15)) * np.uint32(2246822519)
  unit = (h >> 8).astype(jnp.float32) * (2.0 / 2**24) - 1.0    # [-1, 1)
  return (scale * unit).reshape(shape).astype(dtype)


def _made(make, axes, mesh, seed: int):
  """make(seed) jitted straight into its shardings (nothing whole on the host or one device)."""
  import functools
  import jax
  from hitree_jax import sharding
  out = None if mesh is None else sharding.shardings(axes, mesh)
  return jax.jit(functools.partial(make, seed), out_shardings=out)()


class Arrays:
  """Weights and caches of a config's shapes, of arbitrary numbers (`noise`): the abstract ones
  (for their per-device bytes, before anything is made) and the made ones."""

  def __init__(self, config, mesh, draft: bool = False):
    """The target's (tensor-parallel over `model`), or a draft's (split as the engine splits
    it: where the mesh divides it, sharding.splits)."""
    import jax
    from hitree_jax import memory_plan, sharding
    self.config, self.mesh = config, mesh
    self.split = not draft or sharding.splits(config, mesh)
    if draft:
      self.abstract_params = memory_plan.abstract_draft_model(config, mesh)
      self._param_axes = sharding.draft_axes(self.abstract_params, config, mesh)
    else:
      self.abstract_params = memory_plan.abstract_params(config, mesh)
      self._param_axes = memory_plan.params_axes(self.abstract_params)
    leaves, tree = jax.tree.flatten(self.abstract_params)
    self._init = lambda seed: jax.tree.unflatten(tree, [noise(a.shape, a.dtype, seed * 1000 + i, scale=0.02)
                                                        for i, a in enumerate(leaves)])

  def params(self):
    return _made(self._init, self._param_axes, self.mesh, 0)

  def _cache_make(self, context: int):
    import jax
    import jax.numpy as jnp
    from hitree_jax import sharding
    from hitree_jax.cache.full import KVCache
    config = self.config
    slots = engine_slots(context)

    def make(seed):
      empty = KVCache.init(config, 1, slots)
      fill = lambda buf, i: noise(buf.shape, buf.dtype, seed * 1000 + i)
      return empty.replace(keys=tuple(fill(b, 2 * i) for i, b in enumerate(empty.keys)),
                           values=tuple(fill(b, 2 * i + 1) for i, b in enumerate(empty.values)),
                           lengths=jnp.full((1,), context, jnp.int32))

    shapes = jax.eval_shape(lambda: make(0))
    return make, shapes, sharding.cache_axes(shapes, heads=self.split)

  def abstract_cache(self, context: int):
    from hitree_jax import memory_plan
    _, shapes, axes = self._cache_make(context)
    return memory_plan.abstract(shapes, axes, self.mesh)

  def cache(self, context: int, seed: int):
    """A full cache holding `context` committed tokens of arbitrary keys and values, in as many
    slots as the engine would give it (engine_slots)."""
    make, _, axes = self._cache_make(context)
    return _made(make, axes, self.mesh, seed)


def engine_slots(context: int) -> int:
  """The slots of the engine's full cache for `context` tokens: rounded up to its bucket
  (prefill.CACHE_BUCKET), as decoding allocates them. The shape matters on a GPU: over a
  131,008-slot cache the H200's compiler padded each layer's keys to a tile's multiple, a
  copy of the cache in every step, and `ar`'s step took 54 ms; over 131,072 slots, 21.6 ms
  (docs/accelerators.md)."""
  from hitree_jax.decode.prefill import cache_slots
  return cache_slots(context, 0)


def weights_read(arrays: Arrays) -> int:
  """Per-device bytes of the weights one decoding step reads (roofline.weights_read)."""
  from hitree_jax import roofline
  return roofline.weights_read(arrays.abstract_params, arrays.config)


def device_memory_bytes(device) -> float:
  """--memory_gib, else what the device reports it may allocate, else no limit (a CPU)."""
  if FLAGS.memory_gib is not None:
    return FLAGS.memory_gib * 2**30
  stats = device.memory_stats() or {}
  return float(stats.get("bytes_limit", math.inf))


def forward_ms(timed, params, cache, widths) -> dict[int, float]:
  """{w: ms of one forward of w tokens over `cache`} (profile's timing: a program of
  FORWARDS_PER_CALL forwards, the median of --repeats calls)."""
  import jax.numpy as jnp
  from hitree_jax.decode.timing import median_seconds
  from hitree_jax.planner.profile import FORWARDS_PER_CALL
  return {w: 1e3 * median_seconds(timed, params, jnp.zeros((1, w), jnp.int32), cache,
                                  repeats=FLAGS.repeats) / FORWARDS_PER_CALL for w in widths}


def attention_ms(config, cache, widths) -> dict[int, float]:
  """{w: ms the target's layers spend attending w tokens to `cache`}: one layer's attention over
  its keys and values (llama.attention, FORWARDS_PER_CALL in a row, each on the last one's
  output), times the layers. Set beside the target's step, it says whether the long cache or
  the rest of the forward is what costs (on an H200 at 128K the step took twice the sum of
  its parts timed alone: docs/accelerators.md)."""
  import jax
  import jax.numpy as jnp
  from hitree_jax.model import llama
  from hitree_jax.decode.timing import median_seconds
  from hitree_jax.planner.profile import FORWARDS_PER_CALL

  @jax.jit
  def run(q, keys, values, lengths):   # q [1, w, H, D]; keys, values [1, KVH, D, S]
    recent = jnp.zeros((*values.shape[:3], 8), values.dtype)
    attend = jnp.ones((1, q.shape[1], 8), bool)

    def one(_, q):
      return q + 1e-3 * llama.attention(q, recent, recent, attend, context=((keys, values, lengths),))
    return jax.lax.fori_loop(0, FORWARDS_PER_CALL, one, q)

  layer = (cache.keys[0], cache.values[0], cache.lengths)
  return {w: 1e3 * config.num_layers * median_seconds(
              run, jnp.ones((1, w, config.num_heads, config.head_dim), cache.values[0].dtype), *layer,
              repeats=FLAGS.repeats) / FORWARDS_PER_CALL for w in widths}


def _progress(context: int, level: str, ms) -> None:
  """One line as each level is timed, so that a run stopped early (a lent machine's time) still
  says what it measured."""
  shown = ", ".join(f"{w} tok {t:.3f} ms" for w, t in ms.items()) if isinstance(ms, dict) else f"{ms:.3f} ms"
  print(f"  context {context}, {level}: {shown}", flush=True)


def context_row(cfg, target: Arrays, draft: Arrays, params, draft_params, context: int, widths,
                floor_bytes, bandwidth, memory, baseline) -> dict:
  import functools
  import jax
  import jax.numpy as jnp
  from hitree_jax import memory_plan, sharding
  from hitree_jax.decode import long_caches
  from hitree_jax.cache.kinds import RETRIEVAL_CHUNK
  from hitree_jax.decode.timing import median_seconds
  from hitree_jax.planner.profile import timed_forward

  full_bytes = memory_plan.per_device_bytes(target.abstract_cache(context))
  draft_bytes = memory_plan.per_device_bytes(draft.abstract_cache(context))
  need = (memory_plan.per_device_bytes((target.abstract_params, draft.abstract_params)) + full_bytes
          + draft_bytes + memory_plan.per_device_bytes(target.abstract_cache(cfg.budget)))
  row = {"context": context, "bytes_per_device": need}
  if need > HEADROOM * memory:
    row["skipped"] = (f"needs {memory_plan.readable(need)} per device (weights and caches), over "
                      f"{HEADROOM:.0%} of {memory_plan.readable(memory)}")
    return row
  full = target.cache(context, seed=context)
  row["target_ms"] = forward_ms(timed_forward(target.config), params, full, widths)
  _progress(context, "target", row["target_ms"])
  row["attention_ms"] = attention_ms(target.config, full, widths)
  _progress(context, "target's attention to it (one layer alone, x layers)", row["attention_ms"])
  select = functools.partial(long_caches.select_retrieval, params, target.config, full, jnp.zeros((1,), jnp.int32),
                             cfg.budget, RETRIEVAL_CHUNK, 64, sharding.sequence_shards(target.mesh))
  row["select_ms"] = 1e3 * median_seconds(select, repeats=FLAGS.repeats)
  _progress(context, "selection", row["select_ms"])
  retrieval = select()
  del select, full   # the partial holds the full cache too
  gc.collect()
  row["retrieval_ms"] = forward_ms(timed_forward(target.config), params, retrieval, widths)
  _progress(context, retrieval_name(cfg), row["retrieval_ms"])
  del retrieval
  draft_full = draft.cache(context, seed=context + 1)
  streaming = jax.block_until_ready(long_caches.streaming_cache(draft_full, cfg.sinks, cfg.window, None))
  del draft_full
  gc.collect()
  row["draft_ms"] = forward_ms(timed_forward(draft.config), draft_params, streaming, widths)
  _progress(context, streaming_name(cfg), row["draft_ms"])
  row["retrieval_over_baseline"] = {w: row["retrieval_ms"][w] / baseline[w] for w in widths}
  if bandwidth:
    row["floor_ms"] = 1e3 * (floor_bytes + full_bytes) / (bandwidth * 1e9)
    if 1 in widths:
      row["ar_over_floor"] = row["target_ms"][1] / row["floor_ms"]
  return row


def markdown(record) -> str:
  fmt = lambda x: "–" if x is None else f"{x:.2f}"
  widths = [int(w) for w in record["widths"]]
  w_top = max(widths)
  lines = [f"{record['device_kind']} x{record['devices']} ({record['mesh']}), {record['config']}; "
           f"retrieval budget {record['budget']}, draft over {record['sinks']}+{record['window']} slots; "
           f"ms per forward ({w_top} tokens for the levels).", "",
           f"| context | `ar` step ms | of it, attention | HBM floor ms | x floor | target, {w_top} tokens | "
           f"retrieval, {w_top} tokens | x a {record['budget']}-token forward | selection ms | draft, {w_top} tokens |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in record["rows"]:
    if "skipped" in r:
      lines.append(f"| {r['context']} | skipped: {r['skipped']} ||||||||")
      continue
    get = lambda name, w: r[name].get(w, r[name].get(str(w)))
    one = lambda name: fmt(get(name, 1) if 1 in widths and name in r else None)
    lines.append(f"| {r['context']} | {one('target_ms')} | {one('attention_ms')} | {fmt(r.get('floor_ms'))} | "
                 f"{fmt(r.get('ar_over_floor'))} | {fmt(get('target_ms', w_top))} | "
                 f"{fmt(get('retrieval_ms', w_top))} | {fmt(get('retrieval_over_baseline', w_top))} | "
                 f"{fmt(r['select_ms'])} | {fmt(get('draft_ms', w_top))} |")
  return "\n".join(lines)


def main(argv):
  del argv
  cfg = FLAGS.shapes
  if cfg is None:
    raise UsageError("--shapes: name a shapes config, e.g. configs/llama2_7b_128k.py")
  contexts, widths = common.positive_ints("prompt_tokens"), common.positive_ints("widths")
  if cfg.get("levels"):
    if FLAGS.topology is None:
      raise UsageError(f"--shapes names levels ({cfg.levels}): a stack's round is costed on paper only; "
                       "add --topology (e.g. v5e:2x4). Timed, launch.level_cost costs TriForce's levels "
                       "(configs/llama2_7b_128k.py)")
    if not FLAGS["prompt_tokens"].present and cfg.get("prompt_tokens"):
      contexts = [cfg.prompt_tokens]   # the config's own chat
    return write(round_on_paper(cfg, contexts), round_markdown)
  if FLAGS.acceptance_length is not None:
    raise UsageError("--acceptance_length predicts a round of a config that names its levels "
                     "(configs/llama3_8b_eagle3.py); this config costs TriForce's levels")
  if min(contexts) <= cfg.budget:
    raise UsageError(f"--prompt_tokens={','.join(FLAGS.prompt_tokens)}: each must exceed the retrieval budget "
                     f"({cfg.budget}), or there is nothing to retrieve from")
  if contexts != sorted(contexts) or min(widths) < 1 or FLAGS.repeats < 1:
    raise UsageError("--prompt_tokens must be increasing, --repeats >= 1")
  if FLAGS.bandwidth_gb_s is not None and not FLAGS.bandwidth_gb_s > 0:
    raise UsageError(f"--bandwidth_gb_s={FLAGS.bandwidth_gb_s} must be > 0")
  if FLAGS.topology is not None:
    return write(on_paper(cfg, contexts, widths), paper_markdown)
  mesh = common.mesh_from_flags(FLAGS)
  import jax
  from hitree_jax import memory_plan, sharding
  from hitree_jax.planner.profile import timed_forward

  target_config, draft_config = memory_plan.shapes_models(cfg)
  if max(contexts) + max(widths) > target_config.max_position_embeddings:
    raise UsageError(f"--prompt_tokens: {max(contexts)} + {max(widths)} tokens is past the target's "
                     f"{target_config.max_position_embeddings} positions")
  sharding.check(target_config, mesh, 1, max(contexts))
  device = jax.devices()[0]
  bandwidth = FLAGS.bandwidth_gb_s or memory_plan.device_bandwidth_gb_s(device.device_kind)
  memory = device_memory_bytes(device)
  target, draft = Arrays(target_config, mesh), Arrays(draft_config, mesh, draft=True)
  from hitree_jax import provenance
  record = {**provenance.stamp(), "config": config_flags.get_config_filename(FLAGS["shapes"]),
            "device_kind": device.device_kind,
            "devices": 1 if mesh is None else mesh.size, "mesh": sharding.describe(mesh),
            "bandwidth_gb_s": bandwidth, "memory_gib": None if math.isinf(memory) else memory / 2**30,
            "budget": cfg.budget, "sinks": cfg.sinks, "window": cfg.window, "widths": widths,
            "repeats": FLAGS.repeats, "weights_read_bytes": weights_read(target),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
  with sharding.use(mesh):
    params, draft_params = target.params(), draft.params()
    small = target.cache(cfg.budget, seed=0)
    record["baseline_ms"] = forward_ms(timed_forward(target_config), params, small, widths)
    _progress(cfg.budget, "target (baseline)", record["baseline_ms"])
    del small
    for context in contexts:
      row = context_row(cfg, target, draft, params, draft_params, context, widths,
                        record["weights_read_bytes"], bandwidth, memory, record["baseline_ms"])
      record["rows"].append(row)
      print(f"context {context}: " + (row.get("skipped") or
            f"ar step {row['target_ms'].get(1, float('nan')):.2f} ms, retrieval "
            f"{row['retrieval_ms'][max(widths)]:.2f} ms"), flush=True)
      gc.collect()
  write(record, markdown)


def write(record: dict, table_of) -> None:
  """Prints the record's table (and with --json the record), and writes both under --out."""
  table = table_of(record)
  print(table)
  if FLAGS.out and common.writes_outputs():   # process 0 of a multi-host run
    out = pathlib.Path(FLAGS.out)
    out.write_text(json.dumps(record, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
  if FLAGS.json:
    print(json.dumps(record))


ROOFLINE = "roofline from the TPU compiler's cost analysis, not measured"


def cost_record(cost) -> dict:
  """A roofline.ForwardCost as its record: its fields, its roofline seconds, bound and ratio."""
  return dict(dataclasses.asdict(cost), seconds=cost.seconds, over_ideal=cost.over_ideal, bound=cost.bound)


def on_paper(cfg, contexts: list[int], widths: list[int]) -> dict:
  """Each level's forward compiled for --topology: its flops, HBM bytes and roofline time."""
  from hitree_jax import memory_plan, roofline, sharding, topology
  from hitree_jax.decode.prefill import round_up
  mesh = topology.mesh(FLAGS.topology, FLAGS.mesh or None)
  target, draft = memory_plan.shapes_models(cfg)
  sharding.check(target, mesh, 1, max(contexts))
  chip = roofline.Chip.of(mesh.devices.flat[0])
  levels = roofline.Levels(target, draft, mesh, chip)
  tail = round_up(cfg.max_new_tokens + max(widths), 8)
  as_dicts = lambda costs: [cost_record(c) for c in costs]
  rows = [{"level": "target", "context": c, "costs": as_dicts(levels.target_full(c, widths))} for c in contexts]
  rows.append({"level": retrieval_name(cfg), "context": contexts[0],
               "costs": as_dicts(levels.retrieval(contexts[0], cfg.budget, 8, tail, widths))})
  rows.append({"level": streaming_name(cfg), "context": contexts[0],
               "costs": as_dicts(levels.draft_streaming(contexts[0], cfg.sinks, cfg.window, widths))})
  rows += [{"level": "eagle", "context": c, "costs": as_dicts(levels.eagle(c, widths))} for c in contexts]
  from hitree_jax import provenance
  return {**provenance.stamp(), "libtpu": provenance.libtpu_version(), "source": ROOFLINE, "compiler": "tpu", "topology": FLAGS.topology,
          "device_kind": chip.kind,
          "devices": mesh.size, "mesh": sharding.describe(mesh), "bandwidth_gb_s": chip.bandwidth_gb_s,
          "peak_tflops": chip.peak_tflops, "config": config_flags.get_config_filename(FLAGS["shapes"]),
          "budget": cfg.budget, "sinks": cfg.sinks, "window": cfg.window, "widths": widths,
          "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


def paper_markdown(record) -> str:
  lines = [f"{record['device_kind']} x{record['devices']} ({record['mesh']}, {record['topology']}), "
           f"{record['config']}: {record['source']}; per device, at {record['bandwidth_gb_s']:g} GB/s and "
           f"{record['peak_tflops']:g} TFLOP/s.", "",
           "| level | context | tokens | roofline ms | bound | HBM GB | must read GB | x that | GFLOP |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in record["rows"]:
    context = row["context"] if row["level"] in ("target", "eagle") else "any"
    for c in row["costs"]:
      lines.append(f"| {row['level']} | {context} | {c['width']} | {1e3 * c['seconds']:.3f} | {c['bound']} | "
                   f"{c['hbm_bytes'] / 1e9:.3f} | {c['ideal_bytes'] / 1e9:.3f} | {c['over_ideal']:.2f} | "
                   f"{c['flops'] / 1e9:.1f} |")
  return "\n".join(lines)


def round_on_paper(cfg, contexts: list[int]) -> dict:
  """A round of the config's stack (a drafter right under the target) against `ar`'s step, each
  compiled for --topology: the target's one-token forward, its verification of a round and the
  drafter's proposal; with --acceptance_length, each benchmark's predicted speedup."""
  from hitree_jax import memory_plan, provenance, roofline, sharding, topology
  from hitree_jax.planner import on_paper
  published = on_paper.load_acceptance_length(FLAGS.acceptance_length) if FLAGS.acceptance_length else None
  mesh = topology.mesh(FLAGS.topology, FLAGS.mesh or None)
  target, draft = memory_plan.shapes_models(cfg)
  stack = memory_plan.shapes_stack(cfg, target, draft)
  if stack.drafter is None or stack.verifiers:
    raise UsageError(f"--shapes.levels={cfg.levels}: costs a drafter right under the target (sd, tree), "
                     "not `ar` or a hierarchy")
  if published and published.get("stack"):
    from hitree_jax import stacks
    if stacks.build(published["stack"], target, draft) != stack:
      raise UsageError(f"--acceptance_length={FLAGS.acceptance_length}: its taus are for {published['stack']}, "
                       f"not the config's {cfg.levels}: add --shapes.levels={published['stack']}")
  sharding.check(target, mesh, 1, max(contexts))
  chip = roofline.Chip.of(mesh.devices.flat[0])
  levels = roofline.Levels(target, draft, mesh, chip)
  verify_width = levels.verify_width(stack)
  if max(contexts) + verify_width > target.max_position_embeddings:
    raise UsageError(f"--prompt_tokens: {max(contexts)} + a round's {verify_width} tokens is past the target's "
                     f"{target.max_position_embeddings} positions")
  rows = []
  for context in contexts:
    step, verify = levels.target_full(context, [1, verify_width])
    proposal = levels.draft_round(stack, context)
    row = {"context": context, "ar": cost_record(step), "verify": cost_record(verify), "draft": cost_record(proposal),
           "round_seconds": verify.seconds + proposal.seconds}
    row["break_even_tau"] = row["round_seconds"] / step.seconds   # tokens a round must commit to match `ar`
    if published:
      row["predicted"] = {name: tau * step.seconds / row["round_seconds"]
                          for name, tau in published["acceptance_length"].items()}
    rows.append(row)
  return {**provenance.stamp(), "libtpu": provenance.libtpu_version(), "source": ROOFLINE, "compiler": "tpu", "topology": FLAGS.topology,
          "device_kind": chip.kind, "devices": mesh.size, "mesh": sharding.describe(mesh),
          "bandwidth_gb_s": chip.bandwidth_gb_s, "peak_tflops": chip.peak_tflops,
          "config": config_flags.get_config_filename(FLAGS["shapes"]), "levels": str(cfg.levels),
          "drafter": str(stack.drafter), "tree_nodes": stack.tree.size, "verify_width": verify_width,
          "acceptance_length": published, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


def round_markdown(record) -> str:
  lines = [f"{record['device_kind']} x{record['devices']} ({record['mesh']}, {record['topology']}), "
           f"{record['config']}: `{record['levels']}`; {record['source']}; per device.", "",
           "| context | part of a round | tokens | roofline ms | bound | HBM GB | must read GB | x that |",
           "|---|---|---|---|---|---|---|---|"]
  parts = (("ar", "`ar` step (the target, 1 token)"), ("verify", "the target verifies"),
           ("draft", f"{record['drafter']} proposes"))
  for row in record["rows"]:
    for key, label in parts:
      c = row[key]
      lines.append(f"| {row['context']} | {label} | {c['width']} | {1e3 * c['seconds']:.3f} | {c['bound']} | "
                   f"{c['hbm_bytes'] / 1e9:.3f} | {c['ideal_bytes'] / 1e9:.3f} | {c['over_ideal']:.2f} |")
  lines += ["", "A round costs as much as " + ", ".join(
      f"{row['break_even_tau']:.2f} `ar` steps at {row['context']} tokens" for row in record["rows"])
      + ": the mean tokens per round (tau) it must commit to match `ar`."]
  published = record.get("acceptance_length")
  if published:
    lines += ["", f"Predicted from published acceptance lengths ({published['source']}):", "",
              "| context | benchmark | tau | predicted x `ar` |", "|---|---|---|---|"]
    for row in record["rows"]:
      for name, speedup in row["predicted"].items():
        lines.append(f"| {row['context']} | {name} | {published['acceptance_length'][name]:g} | {speedup:.2f}x |")
  return "\n".join(lines)


def run():
  common.run(main, config_sets_flags=False)


if __name__ == "__main__":
  run()
