"""What every published draft's reader shares (medusa_format.py, dflash_format.py, eagle3.py): its
safetensors file found beside its config (a pickle refused), tensors read with their shapes
checked and every one accounted for, and a decoder layer in the layout heads/ computes with."""

from __future__ import annotations

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from hitree_jax.errors import UsageError
from hitree_jax.loading.hf import pickle_refused, pickles_to_safetensors
from hitree_jax.model.config import ModelConfig

_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
_QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def weights_file(folder: pathlib.Path, weights: str, config: str, pickles: tuple[str, ...],
                 flag: str) -> pathlib.Path:
  """folder/weights; a pickle there instead is refused with the launch.convert --flag that
  rewrites it (unpickling runs code, so it is never opened at run time)."""
  path = folder / weights
  if not path.is_file():
    pickle = next((folder / name for name in pickles if (folder / name).is_file()), None)
    if pickle is not None:
      raise pickle_refused(pickle, flag, folder, weights)
    raise UsageError(f"{folder}: no {weights} beside its {config}")
  return path


def rewrite_pickle(folder: pathlib.Path, out: pathlib.Path, *, kind: str, weights: str, config: str,
                   pickles: tuple[str, ...], marks: str) -> pathlib.Path:
  """Rewrites the pickle a `kind` draft was published with (one of `pickles` beside its config,
  which names `marks`) as out/weights, config copied; returns that file. It needs torch, the only
  reader of the pickle, and runs from launch.convert, never at load time."""
  from hitree_jax import shipped
  folder, out = pathlib.Path(folder), pathlib.Path(out)
  pickle = next((folder / name for name in pickles if (folder / name).is_file()), None)
  if shipped.published_kind(folder) != kind or pickle is None:
    raise UsageError(f"--{kind}={folder}: expected a folder with a {config} naming {marks} "
                     f"and {' or '.join(pickles)}")
  out.mkdir(parents=True, exist_ok=True)
  if out.resolve() != folder.resolve():
    shutil.copyfile(folder / config, out / config)
  return pickles_to_safetensors([pickle], out / weights, kind)


class Tensors:
  """A safetensors file read by name (each with `prefix` before it), each tensor's shape checked
  before it is read; `finish` refuses any tensor that was not taken. A context manager."""

  def __init__(self, path: pathlib.Path, prefix: str = ""):
    self.path, self.prefix, self.used = path, prefix, set()

  def __enter__(self) -> "Tensors":
    self._file = safetensors.safe_open(self.path, framework="numpy").__enter__()
    self.names = set(self._file.keys())
    return self

  def __exit__(self, *exc):
    return self._file.__exit__(*exc)

  def has(self, name: str) -> bool:
    return self.prefix + name in self.names

  def take(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """The tensor `name` [shape] (in dtype; None: as stored); a missing or misshapen one named."""
    name = self.prefix + name
    if name not in self.names:
      raise UsageError(f"{self.path} lacks {name}")
    found = tuple(self._file.get_slice(name).get_shape())
    if found != shape:
      raise UsageError(f"{self.path}: {name} has shape {found}, expected {shape}")
    self.used.add(name)
    tensor = self._file.get_tensor(name)
    return tensor if dtype is None else np.asarray(tensor, dtype)

  def finish(self, unused: str) -> None:
    """Refuses the first tensor not taken: '{path}: {name}: a tensor {unused}'."""
    left = sorted(self.names - self.used)
    if left:
      raise UsageError(f"{self.path}: {left[0]}: a tensor {unused}")


def layer_shapes(c: ModelConfig, in_width: int, extra_norms=None) -> dict[str, tuple[int, ...]]:
  """The shapes of a Llama or Qwen3 decoder layer's parameters in heads/'s layout: "q", "k", "v",
  "o", "gate", "up", "down" (kernels [in, out]; q, k and v read in_width inputs), their biases
  (c.qkv_bias), "input_norm", "post_norm", "q_norm", "k_norm" (c.qk_norm) and extra_norms [E]."""
  e, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
  shapes = {"q": (in_width, q), "k": (in_width, kv), "v": (in_width, kv), "o": (q, e),
            "gate": (e, i), "up": (e, i), "down": (i, e)}
  if c.qkv_bias:
    shapes |= {f"{key}_bias": shapes[key][1:] for key in "qkvo"}
  norms = {**_NORMS, **(_QK_NORMS if c.qk_norm else {}), **(extra_norms or {})}
  return shapes | {key: (c.head_dim,) if key in _QK_NORMS else (e,) for key in norms}


def random_layer(c: ModelConfig, in_width: int, key, scale: float, extra_norms=None) -> dict:
  """A layer of layer_shapes' layout to train from: its matrices and biases normal(0, scale),
  float32; its norms ones."""
  shapes = layer_shapes(c, in_width, extra_norms)
  keys = jax.random.split(key, len(shapes))
  return {name: (jnp.ones(shape, jnp.float32) if len(shape) == 1 and not name.endswith("_bias")
                 else scale * jax.random.normal(k, shape, jnp.float32))
          for k, (name, shape) in zip(keys, shapes.items())}


def decoder_layer(tensors: Tensors, prefix: str, c: ModelConfig, in_width: int, extra_norms=None) -> dict:
  """A Llama or Qwen3 decoder layer's tensors under `prefix` (HF's names) -> layer_shapes' layout."""
  names = {**_PROJECTIONS, **{f"{key}_bias": _PROJECTIONS[key] for key in "qkvo"}, **_NORMS, **_QK_NORMS,
           **(extra_norms or {})}
  layer = {}
  for key, shape in layer_shapes(c, in_width, extra_norms).items():
    if key in _PROJECTIONS:   # stored [out, in]
      layer[key] = np.ascontiguousarray(tensors.take(f"{prefix}{names[key]}.weight", shape[::-1]).T)
    else:
      layer[key] = tensors.take(f"{prefix}{names[key]}.{'bias' if key.endswith('_bias') else 'weight'}", shape)
  return layer


def layer_tensors(layer: dict, prefix: str, extra_norms=None) -> dict[str, np.ndarray]:
  """decoder_layer's inverse: a layer in heads/' layout -> HF's tensors under `prefix` (kernels
  stored [out, in]), as a published draft holds them."""
  names = {**_PROJECTIONS, **{f"{key}_bias": _PROJECTIONS[key] for key in "qkvo"}, **_NORMS, **_QK_NORMS,
           **(extra_norms or {})}
  out = {}
  for key, value in layer.items():
    value = np.asarray(value)
    if key in _PROJECTIONS:
      out[f"{prefix}{names[key]}.weight"] = np.ascontiguousarray(value.T)
    else:
      out[f"{prefix}{names[key]}.{'bias' if key.endswith('_bias') else 'weight'}"] = value
  return out
