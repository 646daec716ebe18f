"""What each level's forward costs on an accelerator, on paper: its flops and HBM bytes as the
compiler builds the program, and the roofline time they imply.

A level's round runs one forward of w tokens through its model over its long cache (and a small
recent cache), logits included: the program planner/profile.py times. Here that forward is
compiled once, alone (a loop of them would be counted per trip), with abstract arrays sharded
over a mesh: a TPU slice's compile-only devices (topology.py) or the devices present. From the
compiled program:

  flops          cost_analysis()["flops"], per device;
  hbm_bytes      the bytes the program reads from and writes to HBM, per device, summed from its
                 final HLO's memory spaces (hbm_traffic.py; the analysis's own "bytes accessed"
                 counts VMEM copies of the weights too, 4.5x the weights on a v5e);
  ideal_bytes    what the level must read: its weights (an embedding lookup reads one row) and
                 its long cache's keys and values, per device;
  seconds        the roofline: max(hbm_bytes / the chip's bandwidth, flops / its peak).

These are a roofline from the compiler's program, not a measurement: they leave out launch and
collective latencies and assume the chip streams HBM at its stated bandwidth.

Levels, named as in the --levels grammar (planner/profile.py):
  target                    the target over its full cache of the context
  retrieval:B               the target over a B-slot retrieval cache chosen from it (TriForce)
  draft@streaming:SxW       a draft model over a StreamingLLM cache of S sinks and W recent slots
  eagle                     an EAGLE layer (the target's width, one layer) over its own cache of
                            the context, with the target's head

and a feature drafter's whole proposal of a round (`draft_round`: EAGLE-3's layers once per depth
of its tree with its own head, DFlash's one block forward), compiled from the drafter's own
`propose` as the decode loop calls it. Its code has no loop, so the program is the round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hitree_jax import hbm_traffic, memory_plan, sharding
from hitree_jax.cache.kinds import Retrieval, Streaming
from hitree_jax.decode import retrieve, spec
from hitree_jax.cache.full import KVCache, dtypes_of
from hitree_jax.cache.streaming import StreamingCache
from hitree_jax.decode.drafters import DraftInputs, round_attend
from hitree_jax.decode.levels import Lead, LevelCache
from hitree_jax.decode.stack import Stack
from hitree_jax.decode.sizes import MIN_RECENT_SLOTS as RECENT_SLOTS  # a level's recent cache in decoding
from hitree_jax.decode.sizes import StackSizes
from hitree_jax.errors import UsageError
from hitree_jax.heads import eagle as eagle_lib
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward
from hitree_jax.tree.shapes import DynamicTree

# Dense bfloat16 peak per device, TFLOP/s, as the vendors state it, by what jax's device_kind
# contains (the first match wins). A v4 device is one TensorCore, half a chip.
PEAK_TFLOPS = (("TPU v5 lite", 197), ("TPU v6 lite", 918), ("TPU v5", 459), ("TPU v4", 137.5),
               ("H100 PCIe", 756), ("H100", 989), ("H200", 989), ("A100", 312))


def peak_tflops(device_kind: str) -> float | None:
  """A device's dense bfloat16 peak (PEAK_TFLOPS), or None for one not listed (a CPU)."""
  return next((float(t) for name, t in PEAK_TFLOPS if name.lower() in device_kind.lower()), None)


@dataclasses.dataclass(frozen=True)
class Chip:
  """What a roofline divides by: bytes per second and flops per second, per device."""
  kind: str
  bandwidth_gb_s: float
  peak_tflops: float

  @classmethod
  def of(cls, device) -> "Chip":
    kind = device.device_kind
    bandwidth, peak = memory_plan.device_bandwidth_gb_s(kind), peak_tflops(kind)
    if bandwidth is None or peak is None:
      raise UsageError(f"no bandwidth or peak flops known for {kind!r} (memory_plan.DEVICE_BANDWIDTH_GB_S, "
                       "roofline.PEAK_TFLOPS)")
    return cls(kind, bandwidth, peak)


@dataclasses.dataclass(frozen=True)
class ForwardCost:
  """One forward of `width` tokens of a level, per device."""
  level: str
  width: int
  flops: float
  hbm_bytes: int
  ideal_bytes: int
  compiler_bytes: float    # cost_analysis's "bytes accessed" (every memory), for reference
  memory_seconds: float    # hbm_bytes at the chip's bandwidth
  compute_seconds: float   # flops at the chip's peak

  @property
  def seconds(self) -> float:
    """The roofline: the larger of the two."""
    return max(self.memory_seconds, self.compute_seconds)

  @property
  def over_ideal(self) -> float:
    return self.hbm_bytes / self.ideal_bytes

  @property
  def bound(self) -> str:
    return "memory" if self.memory_seconds >= self.compute_seconds else "compute"


def weights_read(params, config: ModelConfig) -> int:
  """Per-device bytes of the weights one forward reads: all but the embedding table, of which a
  lookup reads a row (unless the head is that table)."""
  params = dict(params)
  if not config.tie_word_embeddings:
    params.pop("embed_tokens", None)
  return memory_plan.per_device_bytes(params)


def kv_bytes(cache) -> int:
  """Per-device bytes of a cache's keys and values."""
  return memory_plan.per_device_bytes((cache.keys, cache.values))


def forward_inputs(config: ModelConfig, tokens, long):
  """What a level's forward of a chain of tokens [B, w] over `long` reads beside them, as in a
  round, in forward's order: the chain's positions after `long`, an empty recent cache, its
  causal mask."""
  w = tokens.shape[1]
  recent = KVCache.init(config, tokens.shape[0], RECENT_SLOTS, **dtypes_of(long))
  positions = long.next_positions[:, None] + jnp.arange(w)[None, :]
  attend = round_attend(recent.lengths, RECENT_SLOTS, jnp.tril(jnp.ones((w, w), bool)))
  return positions, recent, attend


def _forward(config: ModelConfig):
  """One forward of w tokens through the model over `long` and an empty recent cache -> logits."""
  def run(params, tokens, long):
    logits, _, _ = forward(params, config, tokens, *forward_inputs(config, tokens, long), context=(long,))
    return logits
  return jax.jit(run)


def _eagle_forward(config: ModelConfig):
  """One depth of an EAGLE draft: w tokens with their features through its layer, then the head."""
  def run(params, embedding, tokens, long):
    prev = jnp.zeros((*tokens.shape, config.hidden_size), long.values[0].dtype)
    out, _ = eagle_lib.features(params, config, embedding, tokens, prev, *forward_inputs(config, tokens, long),
                                context=(long,))
    return eagle_lib.logits(params, out, reduced=False)
  return jax.jit(run)


def compiled_cost(level: str, width: int, compiled, ideal_bytes: int, chip: Chip) -> ForwardCost:
  """A compiled forward's figures and roofline on `chip`."""
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  flops = float(analysis.get("flops", 0.0))
  hbm = hbm_traffic.hbm_bytes(compiled.as_text())
  return ForwardCost(level, width, flops, hbm, ideal_bytes, float(analysis.get("bytes accessed", 0.0)),
                     memory_seconds=hbm / (chip.bandwidth_gb_s * 1e9),
                     compute_seconds=flops / (chip.peak_tflops * 1e12))


class Levels:
  """The abstract weights and caches of a shapes config's levels on a mesh, and each level's
  compiled forward cost. target, draft: ModelConfigs; the target is tensor-parallel, the draft
  and an EAGLE layer replicated (as the engine places them)."""

  def __init__(self, target: ModelConfig, draft: ModelConfig | None, mesh, chip: Chip):
    self.target, self.draft, self.mesh, self.chip = target, draft, mesh, chip
    self.params = memory_plan.abstract_params(target, mesh)
    self.draft_params = None if draft is None else memory_plan.abstract_draft_model(draft, mesh)

  def _full(self, config: ModelConfig, slots: int, heads: bool):
    shape = jax.eval_shape(lambda: KVCache.init(config, 1, slots))
    return memory_plan.abstract(shape, sharding.cache_axes(shape, heads=heads), self.mesh)

  def _cost(self, level: str, widths, program, args_of, ideal: int) -> list[ForwardCost]:
    with sharding.use(self.mesh):
      return [compiled_cost(level, w, program.lower(*args_of(jax.ShapeDtypeStruct((1, w), jnp.int32))).compile(),
                            ideal, self.chip) for w in widths]

  def target_full(self, context: int, widths) -> list[ForwardCost]:
    """The target over its full cache of `context` slots."""
    full = self._full(self.target, context, heads=True)
    ideal = weights_read(self.params, self.target) + kv_bytes(full)
    return self._cost("target", widths, _forward(self.target), lambda t: (self.params, t, full), ideal)

  def retrieval(self, context: int, budget: int, chunk: int, tail: int, widths) -> list[ForwardCost]:
    """The target over a retrieval cache of `budget` slots (+ `tail`) chosen from a full cache of
    `context` slots: it must read none of the full cache."""
    full = self._full(self.target, context, heads=True)
    with sharding.use(self.mesh):
      shape = jax.eval_shape(lambda p, f: retrieve.from_full(p, self.target, f, jnp.zeros((1,), jnp.int32),
                                                                  budget, chunk, tail), self.params, full)
    long = memory_plan.abstract(shape, sharding.cache_axes(shape, heads=True, slots=False), self.mesh)
    ideal = weights_read(self.params, self.target) + kv_bytes(long)
    return self._cost(str(Retrieval(budget)), widths, _forward(self.target), lambda t: (self.params, t, long), ideal)

  def draft_streaming(self, context: int, sinks: int, window: int, widths) -> list[ForwardCost]:
    """The draft over a StreamingLLM cache of `sinks` + `window` slots of a `context`-slot prompt."""
    full = jax.eval_shape(lambda: KVCache.init(self.draft, 1, context))
    shape = jax.eval_shape(lambda f: StreamingCache.from_prefill(f, sinks, window), full)
    split = sharding.splits(self.draft, self.mesh)
    long = memory_plan.abstract(shape, sharding.cache_axes(shape, heads=split, slots=False), self.mesh)
    ideal = weights_read(self.draft_params, self.draft) + kv_bytes(long)
    return self._cost(str(spec.Level.of(spec.DraftModel(), Streaming(sinks, window))), widths, _forward(self.draft),
                      lambda t: (self.draft_params, t, long), ideal)

  def eagle(self, context: int, widths) -> list[ForwardCost]:
    """An EAGLE layer of the target's width over its one-layer cache of `context` slots, with the
    target's head on the whole vocabulary and a row of its embedding."""
    config = eagle_lib.layer_config(self.target, self.target.vocab_size)
    dtype = jnp.dtype(config.dtype)
    shapes = dict(jax.eval_shape(lambda: eagle_lib.init_params(config, jax.random.key(0))),
                  head=jax.ShapeDtypeStruct((config.hidden_size, config.vocab_size), dtype))
    params = memory_plan.abstract(shapes, sharding.draft_axes(shapes, config, self.mesh), self.mesh)
    embedding = self.params["embed_tokens"]["embedding"]
    long = self._full(config, context, heads=sharding.splits(config, self.mesh))
    ideal = memory_plan.per_device_bytes(params) + kv_bytes(long)
    return self._cost("eagle", widths, _eagle_forward(config), lambda t: (params, embedding, t, long), ideal)

  def draft_round(self, stack: Stack, context: int) -> ForwardCost:
    """What a drafter right under the target (an EAGLE-3 or DFlash draft, any feature drafter)
    reads and computes to propose one round's tree, over its own cache of a `context`-token
    prompt: its `propose` compiled alone, with the pending tokens of a round and an empty recent
    cache. What it must read is its weights once and its cache; an EAGLE-3 draft runs its layer
    and head once per depth, so it moves about that many times as much. Width: the tree's nodes."""
    drafter, tree = stack.drafter, stack.tree
    with sharding.use(self.mesh):
      a = memory_plan.decode_arguments(self.target, stack, self.mesh, context, max_new_tokens=1)
    sizes, level, long = a.sizes, a.sizes.levels[0], a.longs[0]
    features = jax.ShapeDtypeStruct((1, sizes.recent_slots, (len(sizes.feature_taps) + 1) * self.target.hidden_size),
                                    jnp.dtype(self.target.dtype))
    seq = jax.ShapeDtypeStruct(a.start.seq.shape, jnp.int32)
    sampling, key = memory_plan.abstract_settings()

    def propose(weights, long, seq, end, features, sampling, key):
      recent = sharding.constrain_cache(KVCache.init(level.config, 1, sizes.recent_slots, **dtypes_of(long)),
                                        self.mesh, heads=level.splits_heads, slots=False)
      cache = LevelCache(long, recent)
      inputs = DraftInputs(seq=seq, end=end, lead=Lead.of(seq, end, cache.cached, level.lead), cache=cache,
                           params=weights.target, draft=weights.draft, sampling=sampling, config=self.target,
                           features=features)
      if isinstance(tree, DynamicTree):
        return drafter.propose_dynamic(tree, inputs)
      return drafter.propose(key, tree, inputs)

    ideal = memory_plan.per_device_bytes(a.weights.draft.params) + kv_bytes(long)
    with sharding.use(self.mesh):
      compiled = jax.jit(propose).lower(a.weights, long, seq, a.lengths, features, sampling, key).compile()
    return compiled_cost(str(drafter), tree.size, compiled, ideal, self.chip)

  def verify_width(self, stack: Stack) -> int:
    """Tokens in the target's forward of a round of `stack` (two levels): its pending tokens
    (the root last) and the proposal's nodes."""
    sizes = StackSizes(stack, self.target, stack.draft_config, self.mesh)
    return sizes.levels[-1].lead + stack.tree.size
