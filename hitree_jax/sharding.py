"""Sharding: logical axis names on every parameter and cache array, and rules mapping them to a mesh.

In the manner of MaxText and jax-llm-examples: an array is described by logical
axes (`batch`, `heads`, `kv_heads`, `sequence`, `head_dim`, `embed`, `mlp`,
`vocab`), and RULES map those to the mesh's axes (`data`, `sequence`,
`model`). The target is tensor-parallel over heads, MLP and vocabulary; its
full cache is sharded over KV heads, and over slots when the mesh has a
`sequence` axis; a draft's weights and caches are replicated (or split by
batch).

The engine runs the same code with or without a mesh. The host places weights
and caches on the mesh (`place_params`, `place_cache`); XLA's SPMD partitioner
then partitions each compiled program from those input shardings, and
`constrain` pins the few arrays a program creates itself (a level's recent
cache). Attention over a cache split by slots needs no code of its own: its
online softmax (model.attention) is already the exact rule for combining
per-shard statistics, and the partitioner inserts the reductions. Without a
mesh every function here is the identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import PARAM_AXES

MESH_AXES = ("data", "sequence", "model")
RULES = (("batch", "data"), ("sequence", "sequence"), ("heads", "model"), ("kv_heads", "model"),
         ("mlp", "model"), ("vocab", "model"), ("embed", None), ("head_dim", None))

def use(mesh: Mesh | None):
  """The context to trace and compile a generation's programs in: jax.set_mesh(mesh), through
  which the model and the caches see how a full cache's slots are split
  (cache.full.slot_shards); nothing without a mesh."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def parse_mesh(spec: str) -> dict[str, int]:
  """'data:2,model:4' -> {'data': 2, 'model': 4}; '' -> {} (no mesh)."""
  axes = {}
  for piece in filter(None, (p.strip() for p in spec.split(","))):
    match = re.fullmatch(r"(\w+):(\d+)", piece)
    if not match:
      raise UsageError(f"--mesh piece {piece!r}: expected AXIS:N, e.g. model:8 or data:2,model:4")
    name, size = match.group(1), int(match.group(2))
    if name not in MESH_AXES:
      raise UsageError(f"--mesh axis {name!r} is not one of {MESH_AXES}")
    if name in axes:
      raise UsageError(f"--mesh names the axis {name!r} twice")
    if size < 1:
      raise UsageError(f"--mesh axis {name}:{size}: a size must be >= 1")
    axes[name] = size
  return axes


def make_mesh(axes: dict[str, int] | str, devices=None) -> Mesh | None:
  """A mesh over the first prod(sizes) devices (all of MESH_AXES, absent ones of size 1), or None
  for an empty spec. Axes are Auto: the partitioner propagates shardings (GSPMD)."""
  if isinstance(axes, str):
    axes = parse_mesh(axes)
  if not axes:
    return None
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(axes.get(name, 1) for name in MESH_AXES)
  needed = math.prod(shape)
  if needed > len(devices):
    spec = ",".join(f"{k}:{v}" for k, v in axes.items())
    raise UsageError(f"--mesh={spec} needs {needed} devices; this machine has {len(devices)} "
                     f"({devices[0].platform}). On CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                     "simulates N devices")
  grid = np.array(devices[:needed]).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def spec(mesh: Mesh, axes: tuple) -> PartitionSpec:
  """The PartitionSpec of logical axes (None: replicated along that dimension) under RULES;
  mesh axes of size 1 are dropped, so a spec names only what is really split."""
  physical = nn.logical_to_mesh_axes(axes, RULES)
  return PartitionSpec(*(name if name is not None and mesh.shape[name] > 1 else None
                         for name in physical))


def named(mesh: Mesh, axes: tuple) -> NamedSharding:
  return NamedSharding(mesh, spec(mesh, axes))


def param_axes(params) -> dict:
  """The logical axes of each parameter of a Llama (a pytree like params), as model/llama.py
  declares them (PARAM_AXES, by module and parameter name); an undeclared one is refused."""

  def axes(path, leaf):
    names = tuple(getattr(k, "key", str(k)) for k in path)
    declared = PARAM_AXES.get(names[-2:])
    if declared is None or len(declared) != np.ndim(leaf):
      raise ValueError(f"parameter {'/'.join(names)} (shape {np.shape(leaf)}) has no logical axes "
                       "declared in model/llama.py's PARAM_AXES")
    return declared

  return jax.tree_util.tree_map_with_path(axes, params)


def check(config: ModelConfig, mesh: Mesh | None, batch: int, slots: int) -> None:
  """Refuses a mesh whose axes do not divide what they split (naming both), before any work:
  the target's heads, MLP and vocabulary, the batch, the full cache's `slots`."""
  if mesh is None:
    return
  model, data, sequence = mesh.shape["model"], mesh.shape["data"], mesh.shape["sequence"]
  for what, size in (("query heads", config.num_heads), ("KV heads", config.num_kv_heads),
                     ("MLP width", config.intermediate_size), ("vocabulary", config.vocab_size)):
    if size % model:
      raise UsageError(f"--mesh model:{model} does not divide the target's {size} {what}")
  if batch % data:
    raise UsageError(f"--mesh data:{data} does not divide the batch of {batch} prompts")
  if slots % sequence:
    raise UsageError(f"--mesh sequence:{sequence} does not divide the cache's {slots} slots "
                     "(a multiple of 256: use a power of two)")


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def shardings(axes_tree, mesh: Mesh):
  """The NamedSharding of each leaf of axes_tree (tuples of logical names as leaves)."""
  return jax.tree.map(lambda axes: named(mesh, axes), axes_tree, is_leaf=_is_axes)


def place(tree, axes_tree, mesh: Mesh | None):
  """device_put of each array of tree to the sharding of its logical axes (axes_tree: same
  structure, tuples of names as leaves); the identity without a mesh."""
  if mesh is None:
    return tree
  return jax.device_put(tree, shardings(axes_tree, mesh))


def place_params(params, mesh: Mesh | None):
  """A Llama's params on the mesh, tensor-parallel (param_axes)."""
  return place(params, param_axes(params), mesh)


def cache_axes(cache, heads: bool = True, slots: bool = True):
  """Logical axes of a cache pytree (KVCache, RetrievalCache, StreamingCache), as each cache
  class declares them beside its fields (cache.full.axes_field): split by KV head when `heads`
  (a level with the target's weights) and by slot when `slots` (the full cache). An array in
  a field that declares no axes is refused, not silently replicated."""
  drop = lambda axes: tuple(a if (heads or a != "kv_heads") and (slots or a != "sequence") else None
                            for a in axes)
  declared = {f.name: f.metadata.get("axes") for f in dataclasses.fields(cache)}

  def axes(path, leaf):
    field = path[0].name
    if declared[field] is None or len(declared[field]) != np.ndim(leaf):
      raise ValueError(f"{type(cache).__name__}.{field} (shape {np.shape(leaf)}) declares no logical "
                       f"axes of its rank: give the field cache.full.axes_field(...)")
    return drop(declared[field])

  return jax.tree_util.tree_map_with_path(axes, cache)


def place_cache(cache, mesh: Mesh | None, heads: bool = True, slots: bool = True):
  if mesh is None or cache is None:
    return cache
  return place(cache, cache_axes(cache, heads, slots), mesh)


def constrain(tree, axes_tree, mesh: Mesh | None):
  """with_sharding_constraint of each array to its logical axes, inside a traced program."""
  if mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, shardings(axes_tree, mesh))


def constrain_cache(cache, mesh: Mesh | None, heads: bool = True, slots: bool = True):
  if mesh is None:
    return cache
  return constrain(cache, cache_axes(cache, heads, slots), mesh)


def sequence_shards(mesh: Mesh | None) -> int:
  """How many shards the full cache's slots are split into (1 without a `sequence` axis)."""
  return 1 if mesh is None else mesh.shape["sequence"]


def describe(mesh: Mesh | None) -> str:
  """'data:2,model:4' (axes of size > 1), or 'none'."""
  if mesh is None:
    return "none"
  return ",".join(f"{k}:{v}" for k, v in mesh.shape.items() if v > 1) or "one device"


def splits(config: ModelConfig, mesh: Mesh | None) -> bool:
  """Whether a draft of `config` is split over the mesh's `model` axis as the target is (by head,
  KV head and MLP width): where the axis divides all three. Otherwise it is whole on every device."""
  model = 1 if mesh is None else mesh.shape["model"]
  return model > 1 and not any(n % model for n in (config.num_heads, config.num_kv_heads,
                                                   config.intermediate_size))


# A draft's parameters beyond a Llama's (PARAM_AXES): heads/' layout (kernels [in, out]) by name.
# Anything else (fc, the fusion, norms, Medusa's blocks) is small and stays whole.
DRAFT_AXES = {
    "q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"), "o": ("heads", "embed"),
    "q_bias": ("heads",), "k_bias": ("kv_heads",), "v_bias": ("kv_heads",),
    "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"), "head": ("embed", "vocab"), "embedding": ("vocab", "embed"),
    "heads": (None, "embed", "vocab"),   # Medusa's output matrices [K, E, V]
}


def draft_axes(params, config: ModelConfig, mesh: Mesh | None):
  """The logical axes of a draft's parameters (a Llama's, or heads/' layout): split like the
  target's where `splits(config, mesh)`, an axis kept only where the mesh divides it (a reduced
  vocabulary with its OTHER slot, say); else every array whole."""
  split = splits(config, mesh)
  sizes = {} if mesh is None else {logical: mesh.shape[axis] for logical, axis in RULES if axis}

  def axes(path, leaf):
    names = tuple(getattr(k, "key", str(k)) for k in path)
    declared = PARAM_AXES.get(names[-2:]) or DRAFT_AXES.get(names[-1])
    if not split or declared is None or len(declared) != np.ndim(leaf):
      return (None,) * np.ndim(leaf)
    return tuple(a if a is None or np.shape(leaf)[d] % sizes.get(a, 1) == 0 else None
                 for d, a in enumerate(declared))

  return jax.tree_util.tree_map_with_path(axes, params)


def place_draft(draft, config: ModelConfig, mesh: Mesh | None):
  """A draft's weights (decode.drafters.DraftWeights) on the mesh: its parameters by draft_axes,
  its vocabulary maps whole."""
  if mesh is None or draft is None:
    return draft
  return draft.replace(params=place(draft.params, draft_axes(draft.params, config, mesh), mesh),
                       target_ids=replicate(draft.target_ids, mesh), draft_ids=replicate(draft.draft_ids, mesh))


def replicate(tree, mesh: Mesh | None):
  """Every array of tree whole on every device of the mesh (a small draft's weights)."""
  if mesh is None or tree is None:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def fetch(x) -> np.ndarray:
  """A device array as numpy on this host: on a mesh spanning several processes (multi-host),
  gathered from all of them (every process calls it and gets the whole array)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
