"""ModelConfig: the static description of a Llama-family model.

Frozen and hashable so it can be a static argument of `jax.jit`: one compiled
program per configuration, never a retrace because a dict changed identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from hitree_jax.errors import UsageError

SUPPORTED_ROPE_SCALING = ("linear", "llama3")
# HF `model_type`s whose config.json and tensors this model reproduces exactly.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# config.json keys without a default: their absence is a broken folder, named in one line.
REQUIRED_HF_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads")
# (bos, eos) ids transformers' config class of each type assumes when config.json leaves them out
# (save_pretrained writes only what differs from them).
HF_DEFAULT_TOKEN_IDS = {"llama": (1, 2), "mistral": (1, 2), "qwen2": (None, None), "qwen3": (None, None)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  # Biases on the attention projections: Qwen2's q/k/v (qkv_bias); HF Llama's `attention_bias`
  # puts one on q, k, v and o (qkv_bias and o_bias). The MLP never has any.
  qkv_bias: bool = False
  o_bias: bool = False
  # Qwen3: an RMSNorm over each head's query and each head's key (weights [head_dim]), before RoPE.
  qk_norm: bool = False
  # HF `rope_scaling`, frozen as sorted (key, value) pairs so the config hashes.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  # llama.cpp's `rope_freqs` tensor [head_dim / 2]: each inverse frequency is divided by its
  # factor, after rope_scaling. It is how a GGUF stores Llama 3's `llama3` scaling (the file has
  # no scaling key for it), so a Llama-3.x GGUF loads with these instead of rope_scaling.
  rope_freq_factors: tuple[float, ...] | None = None
  bos_token_id: int | None = 1
  eos_token_id: int | None = 2
  dtype: str = "float32"  # parameter / activation dtype: "float32" or "bfloat16"
  # The dtype every cache of this model stores keys in (None: `dtype`). Queries are rounded to
  # it for their product with the keys, which accumulates in float32. bfloat16 keys halve the
  # bytes the longest product reads; values stay in `dtype` (bfloat16 values read slower on
  # XLA:CPU). It changes the model's numbers slightly, like llama.cpp's 16-bit cache.
  key_dtype: str | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise UsageError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise UsageError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.dtype not in ("float32", "bfloat16"):
      raise UsageError(f"dtype={self.dtype!r}: expected 'float32' or 'bfloat16'")
    if self.key_dtype not in (None, "float32", "bfloat16"):
      raise UsageError(f"key_dtype={self.key_dtype!r}: expected 'float32', 'bfloat16' or None "
                       "(the model's dtype)")
    if self.key_dtype == self.dtype:  # one config (and one compiled program) per cache layout
      object.__setattr__(self, "key_dtype", None)
    if self.rope_scaling is not None:
      kind = self.rope_scaling_dict.get("rope_type", self.rope_scaling_dict.get("type"))
      if kind not in SUPPORTED_ROPE_SCALING and kind != "default":
        raise UsageError(
            f"rope_scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_SCALING}")
    if self.rope_freq_factors is not None:
      factors = tuple(float(f) for f in self.rope_freq_factors)
      if len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors):
        raise UsageError(f"rope_freq_factors: expected head_dim / 2 = {self.head_dim // 2} positive "
                         f"factors, found {len(factors)} (min {min(factors, default=0):g})")
      object.__setattr__(self, "rope_freq_factors", factors)

  @property
  def rope_scaling_dict(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  @property
  def cache_key_dtype(self) -> str:
    return self.key_dtype or self.dtype

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["rope_scaling"] = self.rope_scaling_dict or None
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    d = dict(d)
    d["rope_scaling"] = _freeze_rope_scaling(d.get("rope_scaling"))
    if d.get("rope_freq_factors") is not None:
      d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
    return cls(**d)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], dtype: str = "float32",
              source: str = "config.json") -> "ModelConfig":
    """Builds a config from an HF `config.json` dict of a Llama, Mistral, Qwen2 or Qwen3 model.

    A model type or a setting this model does not implement is refused in one line naming it
    (`source` says which file): loaded anyway, the model would generate wrong text silently.
    A Mistral's `sliding_window` caps max_position_embeddings (hf_max_positions says why).
    """
    _check_hf_keys(hf, source)
    max_positions = hf_max_positions(hf)
    _check_hf_implemented(hf, max_positions, source)
    num_heads = hf["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older
    # config.json files write `rope_theta` and `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
      rope = {}
    default_bos, default_eos = HF_DEFAULT_TOKEN_IDS[hf["model_type"]]
    eos = hf.get("eos_token_id", default_eos)
    if isinstance(eos, (list, tuple)):
      eos = eos[0]
    qkv_bias, o_bias = hf_attention_biases(hf)
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=hf["model_type"] == "qwen3",
        rope_scaling=_freeze_rope_scaling(rope),
        bos_token_id=hf.get("bos_token_id", default_bos),
        eos_token_id=eos,
        dtype=dtype,
    )

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any], dtype: str = "float32",
                         tied: bool = True) -> "ModelConfig":
    """Builds a config from GGUF key/values (architecture `llama`, `qwen2` or `qwen3`)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
      raise UsageError(f"GGUF architecture {arch!r} is not supported; expected llama, qwen2 or qwen3 "
                       "(Llama, Mistral, Qwen2 and Qwen3 models)")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)

    def required(key):
      if meta.get(f"{arch}.{key}") is None:
        raise UsageError(f"the GGUF metadata lacks {arch}.{key}")
      return int(meta[f"{arch}.{key}"])

    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
      scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor"))}
    return cls(
        vocab_size=int(g("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or required("vocab_size"))),
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_layers=required("block_count"),
        num_heads=num_heads,
        num_kv_heads=int(g("attention.head_count_kv", num_heads)),
        head_dim=int(g("attention.key_length") or g("rope.dimension_count") or hidden // num_heads),
        qk_norm=arch == "qwen3",
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings=tied,
        rope_scaling=_freeze_rope_scaling(scaling),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        dtype=dtype,
    )


# The GGUF architectures read (and written: loading/gguf.py architecture), each with its metadata
# under its own name.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def hf_max_positions(hf: Mapping[str, Any]) -> int:
  """max_position_embeddings, capped at a Mistral's `sliding_window`.

  Sliding-window attention over a sequence that fits in the window is full attention, so this
  (full-attention) model is exact up to the window; the engine refuses prompt + new tokens
  beyond max_position_embeddings, with a clear error. `sliding_window: null` is plain Llama.
  """
  positions = hf.get("max_position_embeddings", 2048)
  window = hf.get("sliding_window") if hf["model_type"] == "mistral" else None
  return positions if window is None else min(positions, window)


def hf_attention_biases(hf: Mapping[str, Any]) -> tuple[bool, bool]:
  """(qkv_bias, o_bias): Qwen2 biases q, k and v; a Llama or Qwen3 with `attention_bias` all four."""
  if hf["model_type"] == "qwen2":
    return True, False
  both = hf["model_type"] in ("llama", "qwen3") and bool(hf.get("attention_bias", False))
  return both, both


def _check_hf_keys(hf: Mapping[str, Any], source: str) -> None:
  """A missing required key, then an unsupported model_type, each in one line."""
  for key in REQUIRED_HF_KEYS:
    if hf.get(key) is None:
      raise UsageError(f"{source} lacks {key!r}")
  if hf["model_type"] not in SUPPORTED_MODEL_TYPES:
    raise UsageError(f"{source}: model_type {hf['model_type']!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def _check_hf_implemented(hf: Mapping[str, Any], max_positions: int, source: str) -> None:
  """Refuses settings the model code does not implement, naming the key."""
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):  # transformers' "swish" is SiLU too
    raise UsageError(f"{source}: hidden_act {act!r} is not supported (the MLP is SwiGLU: 'silu')")
  if hf.get("mlp_bias"):
    raise UsageError(f"{source}: mlp_bias=true is not supported (the MLP has no biases)")
  if hf.get("quantization_config"):
    raise UsageError(f"{source}: quantization_config is not supported (quantized HF weights); "
                     "use the unquantized folder")
  window = hf.get("sliding_window")
  sliding = _qwen2_sliding_layers(hf)
  if sliding and window < max_positions:
    raise UsageError(f"{source}: use_sliding_window=true with sliding_window={window} < "
                     f"max_position_embeddings={max_positions} in layers {sliding[0]}-{sliding[-1]} "
                     "is not supported (sliding-window attention is not implemented)")


def _qwen2_sliding_layers(hf: Mapping[str, Any]) -> list[int]:
  """The layers a Qwen2 or Qwen3 config gives a sliding window, by transformers' rule: with
  use_sliding_window, those from max_window_layers on (28 where unset), unless layer_types
  names them. (Mistral's window is every layer's, and caps the context instead.)"""
  if hf["model_type"] not in ("qwen2", "qwen3") or not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
    return []
  kinds = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                    else "full_attention" for i in range(hf["num_hidden_layers"])]
  return [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]


def _freeze_rope_scaling(scaling: Mapping[str, Any] | None):
  if not scaling:
    return None
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
