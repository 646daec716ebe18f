"""Will it fit? Per-device memory of a sharded generation, from compiled programs, without the hardware.

The programs a generation runs are lowered and compiled for a mesh of devices
with abstract arrays (shapes, dtypes and shardings; no weights): one prefill
chunk, the retrieval level's selection, and the whole decode loop (whose
state is what one hierarchy round touches). The devices are a TPU slice's,
compiled for by the TPU compiler itself without a TPU (topology.py: its
figures, `compiler: "tpu"`), or else simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N: `"cpu-simulated"`, an
estimate). XLA's SPMD partitioner splits each program as it would for the
real devices, and the compiled program's memory analysis says, per device,
what its arguments, outputs and temporaries take. The arrays' own per-device bytes are summed from
their shardings: parameters, the target's full cache, the retrieval cache and
the draft's caches.

A device holds, while a program runs: its arguments, its outputs that are not
donated arguments updated in place, and its temporaries. The plan's peak is the
largest of those over the programs, and `fits` compares it with the device's
memory. XLA:CPU's temporaries are only an estimate of an accelerator's: its
kernels, fusions and layouts differ (bfloat16 arithmetic widened to float32;
the TPU compiler once copied a whole cache into a layout of its own where
XLA:CPU updated it in place: cache/full.py put_slots).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax import sharding
from hitree_jax.cache.full import KVCache
from hitree_jax.cache.retrieval import RetrievalCache
from hitree_jax.decode import long_caches, loop
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.programs import CPU_COPY_FREE
from hitree_jax.decode.drafters import DraftWeights
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.decode.sizes import StackSizes, decode_shapes
from hitree_jax.cache.kinds import Full
from hitree_jax.decode.stack import Stack
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import init_params

GIB = 2**30


def abstract(tree, axes, mesh):
  """ShapeDtypeStructs of tree's arrays (abstract or not), each with the sharding of its logical
  axes (axes: tree's structure, tuples of names as leaves); on the first device without a mesh."""
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      sharding.shardings(axes, mesh))


def params_axes(params, split: bool = True):
  """A model's params' logical axes: tensor-parallel (split) or replicated (None everywhere)."""
  return sharding.param_axes(params) if split else jax.tree.map(lambda x: (None,) * x.ndim, params)


def abstract_params(config: ModelConfig, mesh, split: bool = True):
  """A model's params as shapes only, tensor-parallel (split) or replicated."""
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  return abstract(shapes, params_axes(shapes, split), mesh)


def readable(nbytes: float) -> str:
  """'1.87 GiB', '412.0 MiB', '45.2 KiB'."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= size:
      return f"{nbytes / size:.{2 if unit == 'GiB' else 1}f} {unit}"
  return f"{nbytes:.0f} B"


def per_device_bytes(tree) -> int:
  """Bytes of one device's shards of tree's (abstract or real) arrays: the largest device's."""
  totals = {}
  for x in jax.tree.leaves(tree):
    shard = x.sharding.shard_shape(x.shape)
    for device in x.sharding.device_set:
      totals[device] = totals.get(device, 0) + math.prod(shard) * np.dtype(x.dtype).itemsize
  return max(totals.values(), default=0)


def compiler(mesh) -> str:
  """Whose figures a plan over `mesh` gives: "tpu" (the TPU compiler's, for a TPU slice's
  devices) or "cpu-simulated" (XLA:CPU's, an estimate)."""
  return "tpu" if mesh is not None and mesh.devices.flat[0].platform == "tpu" else "cpu-simulated"


def scalar(dtype) -> jax.ShapeDtypeStruct:
  """An abstract scalar argument: a concrete one would be placed on the mesh's devices, which a
  TPU slice compiled for without a TPU does not have."""
  return jax.ShapeDtypeStruct((), jnp.dtype(dtype))


def abstract_settings() -> tuple:
  """(SamplingParams, PRNG key) as abstract arguments."""
  return jax.eval_shape(SamplingParams.create), jax.eval_shape(lambda: jax.random.key(0))


def abstract_draft_weights(stack: Stack, config: ModelConfig, draft_config, mesh) -> DraftWeights | None:
  """The draft's weights as shapes, placed as the engine places them (sharding.place_draft): a
  draft model's, or an EAGLE layer's or Medusa's heads with the target's LM head they read
  (heads/saved.py loads the same), or None."""
  if not stack.uses_draft_weights:
    return None
  shapes = stack.drafter.abstract_heads(config) if stack.drafter is not None else None
  if shapes is None:
    return DraftWeights(abstract_draft_model(draft_config, mesh))
  own = stack.drafter.level_config(config, draft_config)
  return DraftWeights(abstract(shapes, sharding.draft_axes(shapes, own, mesh), mesh))


def abstract_draft_model(config: ModelConfig, mesh):
  """A draft model's params as shapes, placed as the engine places them (sharding.draft_axes)."""
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  return abstract(shapes, sharding.draft_axes(shapes, config, mesh), mesh)


@dataclasses.dataclass(frozen=True)
class Program:
  name: str
  arguments: int     # per device, bytes
  outputs: int
  aliased: int       # outputs that reuse a donated argument's memory
  temporaries: int
  temporaries_cpu: int | None = None  # a bfloat16 program's own, on XLA:CPU (see plan)

  @property
  def peak(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries

  @classmethod
  def of(cls, name: str, compiled) -> "Program":
    m = compiled.memory_analysis()
    return cls(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
               m.temp_size_in_bytes)


def shapes_stack(shapes, target: ModelConfig, draft: ModelConfig | None) -> Stack:
  """The stack a shapes config describes: its `levels` (a --levels spec, e.g. a published draft's
  folder of config.json alone: configs/llama3_8b_eagle3.py), else TriForce's
  (configs/llama2_7b_128k.py): the draft over a StreamingLLM cache of `sinks` + `window` proposes
  chains of `gamma1` to the target over a retrieval cache of `budget` slots, which hands `gamma2`
  tokens up to the target."""
  from hitree_jax import stacks
  from hitree_jax.cache.kinds import Retrieval, Streaming
  from hitree_jax.decode import spec
  if shapes.get("levels"):
    return stacks.build(shapes.levels, target, draft)
  levels = spec.Levels(spec.Level.of(spec.DraftModel(), Streaming(shapes.sinks, shapes.window)),
                       spec.Chain(shapes.gamma1), ((spec.Level.of(Retrieval(shapes.budget)), shapes.gamma2),))
  return stacks.build(levels, target, draft)


def shapes_models(shapes) -> tuple[ModelConfig, ModelConfig | None]:
  """(target, draft model or None) of a shapes config: a draft model's shape only where its stack
  has one (a published draft on the target's features says its own in its config.json)."""
  target = ModelConfig.from_dict(dict(shapes.target))
  draft = ModelConfig.from_dict(dict(shapes.draft)) if shapes.get("draft") else None
  if draft is not None and draft.vocab_size != target.vocab_size:
    raise UsageError(f"the draft's vocabulary ({draft.vocab_size}) is not the target's ({target.vocab_size})")
  return target, draft


def plan(config: ModelConfig, draft: ModelConfig | None, stack_of, mesh, prompt_tokens: int,
         max_new_tokens: int, batch: int = 1) -> dict:
  """Compiles a generation's programs for `mesh` with abstract weights; -> per-device bytes of
  the weights, the caches and each program's arguments, outputs and temporaries, and the peak.

  stack_of(draft) -> the Stack (it is built again for float32). On simulated CPU devices a
  bfloat16 program is compiled a second time in float32: XLA:CPU widens a bfloat16 product's operands (a whole cache) to float32
  where an accelerator multiplies them as they are, and no buffer of the float32 program is
  narrower than its bfloat16 twin's, so each program's temporaries are taken as the smaller of
  the two (`temporaries_cpu` keeps the bfloat16 program's own figure)."""
  with sharding.use(mesh):
    programs, arrays = _compile(config, stack_of(draft), mesh, prompt_tokens, max_new_tokens, batch)
    if config.dtype != "float32" and compiler(mesh) != "tpu":
      f32 = lambda c: None if c is None else c.replace(dtype="float32")
      bound, _ = _compile(f32(config), stack_of(f32(draft)), mesh, prompt_tokens, max_new_tokens, batch)
      programs = [dataclasses.replace(p, temporaries=min(p.temporaries, b.temporaries),
                                      temporaries_cpu=p.temporaries) for p, b in zip(programs, bound)]
  return dict(devices=mesh.devices.size, mesh=sharding.describe(mesh), compiler=compiler(mesh),
              device_kind=mesh.devices.flat[0].device_kind, **arrays,
              programs=[dataclasses.asdict(p) | dict(peak=p.peak) for p in programs],
              peak=max(p.peak for p in programs))


@dataclasses.dataclass(frozen=True)
class DecodeArguments:
  """A generation's arrays as abstract arguments on a mesh: what its programs are compiled with."""
  sizes: StackSizes
  slots: int                 # the full caches' slots
  tail: int                  # the long caches' slots for tokens decoded after the prompt
  params: dict               # the target's weights
  weights: loop.Weights      # the target's and the draft's
  full: KVCache              # the target's full cache
  draft_full: KVCache | None
  longs: tuple               # each level's long cache (None where it has none)
  start: loop.DecodeStart    # the decode loop's start
  lengths: jax.ShapeDtypeStruct   # [batch] int32


def decode_arguments(config: ModelConfig, stack: Stack, mesh, prompt_tokens: int, max_new_tokens: int,
                     batch: int = 1) -> DecodeArguments:
  """The prefill chunk's, the retrieval selection's and the decode loop's arguments for a prompt
  of prompt_tokens, as the engine would shape them (inside sharding.use(mesh))."""
  draft_config = stack.draft_config  # None for a stack without a draft model (EAGLE's, say)
  shapes = decode_shapes(stack, config, prompt_tokens, max_new_tokens, batch, mesh)
  sizes, slots, tail = shapes.sizes, shapes.slots, shapes.tail
  params = abstract_params(config, mesh)
  weights = loop.Weights(params, abstract_draft_weights(stack, config, draft_config, mesh))

  placed = lambda level, shape: abstract(shape, level.long_axes(shape), mesh)
  full = placed(sizes.levels[-1], jax.eval_shape(lambda: KVCache.init(config, batch, slots)))
  draft_full = None
  if draft_config is not None:
    shape = jax.eval_shape(lambda: KVCache.init(draft_config, batch, slots))
    draft_full = abstract(shape, sharding.cache_axes(shape, heads=sharding.splits(draft_config, mesh)), mesh)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)   # also each row's last token
  longs = []
  for level in sizes.levels:
    if level.is_drafter and sizes.drafter.prefills_own_cache:  # e.g. EAGLE's, from the prompt
      shape = jax.eval_shape(lambda: KVCache.init(level.config, batch, slots))
    else:
      shape = jax.eval_shape(lambda: long_caches.derived_long_cache(sizes, level, full, draft_full, params,
                                                                    lengths, tail))
    longs.append(None if shape is None else placed(level, shape))

  features = (len(sizes.feature_taps) + 1) * config.hidden_size   # what a feature drafter reads
  first = (jax.ShapeDtypeStruct((batch, config.vocab_size), jnp.float32),
           jax.ShapeDtypeStruct((batch, features), jnp.dtype(config.dtype)) if sizes.reads_features else None)
  settings, key = abstract_settings()
  start = loop.DecodeStart(first, settings, scalar(jnp.int32), key,
                           jax.ShapeDtypeStruct((batch, shapes.history), jnp.int32), lengths)
  return DecodeArguments(sizes, slots, tail, params, weights, full, draft_full, tuple(longs), start, lengths)


def decode_loop_program(a: DecodeArguments, max_new_tokens: int) -> Program:
  """The decode loop compiled over a generation's abstract arguments (inside sharding.use(mesh)),
  and its memory: where a long cache copied every round would show."""
  compiled = loop.decode_loop.lower(a.sizes, a.weights, a.longs, a.start, max_new_tokens).compile()
  return Program.of("decode loop", compiled)


def _compile(config: ModelConfig, stack: Stack, mesh, prompt_tokens: int, max_new_tokens: int, batch: int):
  """-> ([Program] of the prefill chunk, each retrieval selection and the decode loop, the
  arrays' per-device bytes)."""
  a = decode_arguments(config, stack, mesh, prompt_tokens, max_new_tokens, batch)
  sizes, params, full, longs, draft = a.sizes, a.params, a.full, a.longs, a.weights.draft
  programs = []
  # One prefill chunk: the target's weights, its whole full cache, the chunk's activations.
  tokens = jax.ShapeDtypeStruct((batch, prefill_lib.prefill_chunk_size(prompt_tokens)), jnp.int32)
  hidden = jax.ShapeDtypeStruct((batch, config.hidden_size), jnp.dtype(config.dtype))
  options = CPU_COPY_FREE if compiler(mesh) != "tpu" else None
  compiled = prefill_lib.prefill_chunk.lower(params, config, full, tokens, scalar(jnp.int32), a.lengths,
                                              hidden).compile(options)
  programs.append(Program.of("prefill chunk", compiled))
  for level, long in zip(sizes.levels, longs):  # the retrieval level's selection, from the full cache
    if isinstance(long, RetrievalCache):
      kind, j = level.cache, level.index
      compiled = long_caches.select_retrieval.lower(params, config, full, a.lengths, kind.budget, kind.chunk,
                                                    a.tail, sharding.sequence_shards(mesh)).compile()
      programs.append(Program.of(f"retrieval selection (level {j})", compiled))
  programs.append(decode_loop_program(a, max_new_tokens))

  caches = {}
  for level, long in zip(sizes.levels, longs):
    if long is None:
      continue
    kind = ("retrieval" if isinstance(long, RetrievalCache) else
            "full" if isinstance(long, KVCache) else "streaming")
    who = ("target" if level is sizes.levels[-1] else "draft" if level.weights == "draft" else
           str(stack.drafter).partition(":")[0] if level.is_drafter and sizes.reads_features else
           f"level {level.index}")
    caches[f"{who} {kind} cache"] = per_device_bytes(long)
  if a.draft_full is not None and not any(level.weights == "draft" and isinstance(level.cache, Full)
                                        for level in sizes.levels[:-1]):
    caches["draft full cache (prefill only)"] = per_device_bytes(a.draft_full)
  arrays = dict(slots=a.slots, params=per_device_bytes(params),
                draft_params=per_device_bytes(draft.params) if draft is not None else 0, caches=caches)
  return programs, arrays


# Each kind of accelerator's memory per device, in GiB (HBM as the vendors state it). A v4
# slice's devices are its TensorCores, two to a 32 GiB chip.
DEVICE_MEMORY_GIB = {"v5e": 16, "v5p": 95, "v6e": 32, "v4": 16, "h100": 80, "h200": 141, "a100": 80}

# Memory bandwidth per device, GB/s, as the vendors state it, by what jax's device_kind contains
# (the first match wins: "H100 PCIe" before "H100").
DEVICE_BANDWIDTH_GB_S = (("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350), ("H200", 4800),
                         ("A100-SXM4-80GB", 2039), ("A100-PCIE-80GB", 1935), ("A100", 1555),
                         ("TPU v5 lite", 819), ("TPU v5e", 819), ("TPU v5p", 2765), ("TPU v5", 2765),
                         ("TPU v6 lite", 1640), ("TPU v6e", 1640), ("TPU v4", 1228))


def device_bandwidth_gb_s(device_kind: str) -> float | None:
  """A device's memory bandwidth (DEVICE_BANDWIDTH_GB_S), or None for one not listed (a CPU)."""
  return next((float(bw) for name, bw in DEVICE_BANDWIDTH_GB_S if name.lower() in device_kind.lower()), None)
