"""Hugging Face Llama-family weights (Llama, Mistral, Qwen2, Qwen3) -> our parameter tree.

`params_from_state_dict` is the single place that knows HF's tensor names; the
safetensors and GGUF loaders both produce an HF-named state dict and go
through it. A safetensors tensor is read (from the file's memory map) and converted to the run's
dtype only when the model takes it, then placed before the next: a folder of bfloat16 shards
never sits on the host whole, nor in float32.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np
import safetensors

from hitree_jax.errors import NotFound, UsageError
from hitree_jax.model.config import ModelConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def tolerated(name: str, config: ModelConfig) -> bool:
  """Tensors a checkpoint may hold that the model recomputes or shares: RoPE's inverse
  frequencies (older transformers saved them) and a tied model's `lm_head` (the embedding)."""
  return name.endswith("rotary_emb.inv_freq") or (
      config.tie_word_embeddings and name == "lm_head.weight")


def params_from_state_dict(state: Mapping[str, object], config: ModelConfig,
                           source: str = "checkpoint", dtype: str = "float32",
                           place: Callable | None = None) -> dict:
  """HF names -> nested params; linear weights [out, in] become kernels [in, out].

  A state value is an array (kept in float32 here, converted to `dtype` on the device), or a
  tensor that makes itself when taken, `.shape` and `.array(dtype, transpose)` (a GGUF's
  QuantizedTensor: made in `dtype`, transposed as it is made). `place` takes each tensor as it
  is made (e.g. onto the device), so that the next is made after it: a loader that hands lazy
  tensors never holds the whole model twice.

  Every tensor is accounted for: one the model lacks or one it does not use (a Qwen2's biases
  under a config without them) is a ValueError naming it, rather than wrong text later.
  """
  made = jnp.dtype(dtype)   # numpy's bfloat16 (ml_dtypes) too
  place = place or (lambda w: w)
  missing, used = [], set()
  c = config
  e, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
  out_in = {"q_proj": (q, e), "k_proj": (kv, e), "v_proj": (kv, e), "o_proj": (e, q),
            "gate_proj": (i, e), "up_proj": (i, e), "down_proj": (e, i)}

  def take(name, shape, transpose=False):
    if name not in state:
      missing.append(name)
      return None
    used.add(name)
    value = state[name]
    found = tuple(value.shape) if hasattr(value, "array") else tuple(np.shape(value))
    if found != shape:   # as transformers says it: the tensor, then both shapes
      raise UsageError(f"{source}: {name} has shape {found}; this config expects {shape}")
    if hasattr(value, "array"):
      return place(value.array(made, transpose))
    w = np.asarray(value, dtype=np.float32)
    return place(np.ascontiguousarray(w.T) if transpose else w)

  def linear(name, bias):  # {"kernel" [in, out], "bias" [out] when the config has one}
    shape = out_in[name.rpartition(".")[2]]
    p = {"kernel": take(name + ".weight", shape, True)}
    if bias:
      p["bias"] = take(name + ".bias", shape[:1])
    return p

  biased = {"q_proj": config.qkv_bias, "k_proj": config.qkv_bias, "v_proj": config.qkv_bias,
            "o_proj": config.o_bias}
  params = {"embed_tokens": {"embedding": take("model.embed_tokens.weight", (c.vocab_size, e))},
            "norm": {"weight": take("model.norm.weight", (e,))}}
  for layer in range(config.num_layers):
    p = f"model.layers.{layer}."
    attn = {n: linear(p + f"self_attn.{n}", biased[n]) for n in _ATTN}
    if config.qk_norm:
      attn |= {n: {"weight": take(p + f"self_attn.{n}.weight", (c.head_dim,))} for n in ("q_norm", "k_norm")}
    params[f"layers_{layer}"] = {
        "self_attn": attn,
        "mlp": {n: linear(p + f"mlp.{n}", False) for n in _MLP},
        "input_layernorm": {"weight": take(p + "input_layernorm.weight", (e,))},
        "post_attention_layernorm": {"weight": take(p + "post_attention_layernorm.weight", (e,))},
    }
  if not config.tie_word_embeddings:
    params["lm_head"] = {"kernel": take("lm_head.weight", (c.vocab_size, e), True)}
  if missing:
    raise UsageError(f"{source} lacks {missing[0]}{_and_more(missing)}")
  unused = sorted(n for n in state if n not in used and not tolerated(n, config))
  if unused:
    raise UsageError(f"{source}: {unused[0]}: a tensor this model does not use{_and_more(unused)}")
  return params


def _and_more(names: list[str]) -> str:
  return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def read_config(path: str | pathlib.Path, dtype: str = "float32") -> ModelConfig:
  """The config of an HF folder, from its config.json."""
  config_file = pathlib.Path(path) / "config.json"
  if not config_file.is_file():
    raise NotFound(f"{path}: no config.json (expected an HF model folder)")
  try:
    hf_config = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise UsageError(f"{config_file} is not valid JSON: {e}") from None
  if "tie_word_embeddings" not in hf_config:
    hf_config["tie_word_embeddings"] = False
  return ModelConfig.from_hf(hf_config, dtype=dtype, source=f"config.json at {path}")


@dataclasses.dataclass(frozen=True)
class SafetensorsTensor:
  """A tensor of a safetensors file as params_from_state_dict takes it: its shape from the
  header, its values read only by `array`."""
  path: pathlib.Path
  name: str
  shape: tuple[int, ...]

  def array(self, dtype, transpose: bool = False) -> np.ndarray:
    """The tensor in `dtype` ([in, out] with transpose)."""
    try:
      with safetensors.safe_open(str(self.path), framework="numpy") as f:
        w = np.asarray(f.get_tensor(self.name), dtype)   # bfloat16: ml_dtypes' (jax's) numpy type
    except Exception as e:  # safetensors' SafetensorError, or numpy's on a short buffer
      raise _not_whole(self.path, e) from None
    return np.ascontiguousarray(w.T) if transpose else w


def _not_whole(path: pathlib.Path, e: Exception) -> UsageError:
  return UsageError(f"{path}: not a whole safetensors file ({path.stat().st_size} bytes): "
                    f"{type(e).__name__}: {e}")


def read_safetensors(path: pathlib.Path) -> dict[str, SafetensorsTensor]:
  """A safetensors file's tensors, by name, from its header (nothing is read until taken); a
  cut or corrupt file is one line naming it."""
  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      return {name: SafetensorsTensor(path, name, tuple(f.get_slice(name).get_shape())) for name in f.keys()}
  except Exception as e:  # safetensors' SafetensorError on a cut header or buffer
    raise _not_whole(path, e) from None


def load_safetensors_dir(path: str | pathlib.Path, dtype: str = "float32", place: Callable | None = None):
  """(config, params) from an HF folder: config.json + one or several *.safetensors. Each tensor
  is read into `dtype` when taken and handed to `place` (e.g. to the device) before the next."""
  folder = pathlib.Path(path)
  config = read_config(folder, dtype)
  files = sorted(folder.glob("*.safetensors"))
  pickles = [] if files else pickled_weights(folder)
  if pickles:
    raise pickle_refused(pickles[0], "pickled", folder, "model.safetensors")
  if not files:
    raise NotFound(f"{folder}: no *.safetensors files")
  state = {}
  for f in files:
    state.update(read_safetensors(f))
  return config, params_from_state_dict(state, config, source=str(folder), dtype=dtype, place=place)


def pickled_weights(folder: pathlib.Path) -> list[pathlib.Path]:
  """An HF folder's weights saved as pickles: pytorch_model.bin, or its shards."""
  return sorted(pathlib.Path(folder).glob("pytorch_model*.bin"))


def pickle_refused(pickle: pathlib.Path, flag: str, folder: pathlib.Path, weights: str) -> UsageError:
  """The one-line refusal of a pickle at load time, naming the launch.convert --flag that
  rewrites it as `weights` (unpickling runs code, so it is never opened at run time)."""
  return UsageError(f"{pickle} is a pickle, which is never opened here (loading one runs its code): "
                    f"`python -m launch.convert --{flag}={folder}` writes {weights} (it needs torch)")


def pickles_to_safetensors(pickles, out: pathlib.Path, flag: str) -> pathlib.Path:
  """The state dicts of `pickles` written as the safetensors file `out`, for launch.convert
  --flag: torch, the only reader of a pickle, reads them with weights_only=True (which runs none
  of their code); without torch, one line says how to get it."""
  try:
    import torch
    from safetensors.torch import save_file
  except ImportError:
    raise UsageError(f"--{flag} needs torch to read the pickle: pip install torch "
                     "(./setup.sh --test installs it)") from None
  state = {}
  for pickle in pickles:
    state.update(torch.load(pickle, map_location="cpu", weights_only=True))
  # Tensors that share storage (a tied head and its embedding; Medusa's one block applied L
  # times), which safetensors refuses: each its own.
  save_file({name: tensor.detach().clone().contiguous() for name, tensor in state.items()}, str(out))
  return out


def rewrite_pickled(folder: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
  """An HF folder whose weights are pickles (`pickled_weights`) rewritten as out/model.safetensors,
  its other files (config, tokenizer) copied beside it; returns that file. It needs torch, the only
  reader of a pickle, with weights_only=True (which runs none of its code), and runs from
  launch.convert, never at load time."""
  import shutil
  folder, out = pathlib.Path(folder), pathlib.Path(out)
  pickles = pickled_weights(folder)
  if not (folder / "config.json").is_file() or not pickles:
    raise UsageError(f"--pickled={folder}: expected a model's folder with a config.json and "
                     "pytorch_model.bin (or its shards)")
  out.mkdir(parents=True, exist_ok=True)
  if out.resolve() != folder.resolve():
    for kept in folder.iterdir():
      if kept.is_file() and kept not in pickles and kept.name != "pytorch_model.bin.index.json":
        shutil.copyfile(kept, out / kept.name)
  return pickles_to_safetensors(pickles, out / "model.safetensors", "pickled")
