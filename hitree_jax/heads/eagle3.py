"""Published EAGLE-3 drafts (Li et al. 2025), as `--draft=eagle3:PATH` reads them.

An EAGLE-3 draft reads three layers of its target (a low, a middle and a high one: by default
the inputs of layers 2, L/2 and L-3, i.e. the outputs of layers 1, L/2-1 and L-4, our taps),
fused by `fc` into the draft's width. Its first layer reads, at position p, the target's
embedding of token x_p beside the fused states g of position p-1, each RMS-normalised
(`input_layernorm`, `hidden_norm`), as one [2E] input to its attention; the residual stream
starts from g. Further layers, if any, are plain decoder layers. The last layer's output h_p
is what a child in the draft's tree reads as its g; `norm` then its own `lm_head` over a
smaller vocabulary turn h_p into the draft's distribution of x_{p+1}, and `d2t` maps a draft
id d to the target's id d + d2t[d].

  g_{p-1} = fc([taps at p-1])   h_p = layers([input_norm(embed(x_p)), hidden_norm(g_{p-1})])
  logits_{p+1} = lm_head(norm(h_p))   a child of x_{p+1} reads g = h_p

EagleDrafter (heads/drafter.py) runs it as it runs our own EAGLE draft; only this module's
`Eagle3Net` (how a position's state and logits are computed) differs. A draft vocabulary maps
to a ReducedVocab whose OTHER slot (never proposed) is put before the draft's own ids.

Two formats hold one:
  * the EAGLE authors' folder: config.json (`LlamaForCausalLMEagle3`: the layer's shape,
    `draft_vocab_size`, the target's `vocab_size`) and `midlayer.*`, `fc`, `norm`, `lm_head`,
    `d2t`, `t2d` (and possibly `embed_tokens`) in model.safetensors; the taps are the default;
  * vLLM's speculators folder: config.json with `speculators_model_type: eagle3`, the layer's
    config as `transformer_layer_config`, `eagle_aux_hidden_state_layer_ids` and the norm
    options, and `layers.i.*` for the layers.
A pickle (pytorch_model.bin) is never opened at run time: `launch.convert --eagle3=PATH`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from hitree_jax.cache.full import KVCache, write_slots
from hitree_jax.errors import UsageError
from hitree_jax.heads import published
from hitree_jax.model.config import ModelConfig
from hitree_jax.cache.rope import apply_rope, rope_cos_sin
from hitree_jax.model.llama import attention, rms_norm, rope_inv_freq
from hitree_jax.model.vocab import ReducedVocab

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PICKLES = ("pytorch_model.bin", "model.pt")
CHECKED = ("hidden_size", "target_vocab_size")
FIRST_LAYER_NORMS = {"hidden_norm": "hidden_norm"}   # the first layer's norm of the fused states


def _project(x, layer, name):
  out = jnp.dot(x, layer[name])
  return out + layer[f"{name}_bias"] if f"{name}_bias" in layer else out


@dataclasses.dataclass(frozen=True)
class Eagle3Net:
  """How an EAGLE-3 draft computes a position's state and its logits (EagleDrafter's `net`)."""
  aux: int = 3                        # target layers fc reads
  norm_before_residual: bool = False  # the residual stream starts from hidden_norm(g)
  norm_output: bool = False           # children read norm(h) (Eagle 3.1), and logits skip norm
  eps: float = 1e-6                   # the draft's RMSNorm epsilon

  def fuse(self, params, features):
    """features [..., (aux+1)E] (the taps, then the final states) -> g [..., E] = fc(taps)."""
    e = params["fc"].shape[1]
    return jnp.dot(features[..., :self.aux * e].astype(params["fc"].dtype), params["fc"])

  def features(self, params, config: ModelConfig, embedding, tokens, prev, positions, cache: KVCache,
               attend, write_at=None, context: tuple[KVCache, ...] = ()):
    """States [B, T, E] of tokens [B, T] (target ids) that follow states prev [B, T, E]; writes
    each layer's keys/values into `cache` at write_at (default: its length), uncommitted."""
    write_at = cache.lengths if write_at is None else write_at
    eps, (b, t) = config.rms_norm_eps, tokens.shape
    cos, sin = rope_cos_sin(positions, rope_inv_freq(config))
    embedding = params.get("embedding", embedding)
    h = prev.astype(embedding.dtype)
    keys, values = [], []
    for i, layer in enumerate(params["layers"]):
      if i == 0:
        g = rms_norm(h, layer["hidden_norm"], eps)
        residual = g if self.norm_before_residual else h
        x = jnp.concatenate([rms_norm(jnp.take(embedding, tokens, axis=0), layer["input_norm"], eps), g], axis=-1)
      else:
        residual, x = h, rms_norm(h, layer["input_norm"], eps)
      q = _project(x, layer, "q").reshape(b, t, config.num_heads, config.head_dim)
      k = _project(x, layer, "k").reshape(b, t, config.num_kv_heads, config.head_dim)
      v = _project(x, layer, "v").reshape(b, t, config.num_kv_heads, config.head_dim)
      if "q_norm" in layer:   # a Qwen3 draft layer
        q, k = rms_norm(q, layer["q_norm"], eps), rms_norm(k, layer["k_norm"], eps)
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
      k_buf, v_buf = write_slots(cache.keys[i], k, write_at), write_slots(cache.values[i], v, write_at)
      keys.append(k_buf)
      values.append(v_buf)
      layer_context = tuple((c.keys[i], c.values[i], c.lengths) for c in context)
      out = attention(q, k_buf, v_buf, attend, layer_context).reshape(b, t, config.num_heads * config.head_dim)
      h = residual + _project(out, layer, "o")
      y = rms_norm(h, layer["post_norm"], eps)
      h = h + jnp.dot(jax.nn.silu(jnp.dot(y, layer["gate"])) * jnp.dot(y, layer["up"]), layer["down"])
    state = rms_norm(h, params["norm"], eps) if self.norm_output else h
    return state, cache.replace(keys=tuple(keys), values=tuple(values))

  def abstract_params(self, config: ModelConfig, reduced: bool) -> dict:
    """The shapes of `load`'s parameters for a draft of this config (its vocab_size counting
    OTHER when reduced), in its dtype; without a draft's own copy of the embedding."""
    shape = lambda dims: jax.ShapeDtypeStruct(dims, jnp.dtype(config.dtype))
    e = config.hidden_size
    layers = tuple(jax.tree.map(shape, published.layer_shapes(
        config, 2 * e if i == 0 else e, FIRST_LAYER_NORMS if i == 0 else None), is_leaf=lambda x: isinstance(x, tuple))
        for i in range(config.num_layers))
    return {"fc": shape((self.aux * e, e)), "norm": shape((e,)), "layers": layers,
            "lm_head": shape((e, config.vocab_size - 1 if reduced else config.vocab_size))}

  def logits(self, params, state, reduced: bool):
    """[..., E] states -> float32 logits over the draft's ids; reduced: OTHER first, at -inf."""
    h = state if self.norm_output else rms_norm(state, params["norm"], self.eps)
    out = jnp.dot(h, params["lm_head"]).astype(jnp.float32)
    if reduced:
      out = jnp.concatenate([jnp.full((*out.shape[:-1], 1), -jnp.inf, out.dtype), out], axis=-1)
    return out


# ---- the published formats ----

def rewrite_pickle(folder: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  """Rewrites an EAGLE-3 folder's pickled weights as out/WEIGHTS (config.json copied; needs torch)."""
  return published.rewrite_pickle(folder, out, kind="eagle3", weights=WEIGHTS, config=CONFIG,
                                  pickles=PICKLES, marks="an EAGLE-3 architecture")


def _weights(folder: pathlib.Path) -> pathlib.Path:
  return published.weights_file(folder, WEIGHTS, CONFIG, PICKLES, "eagle3")


def _config_alone(folder: pathlib.Path, hf: dict) -> bool:
  """A folder of config.json alone (no weights, nor a pickle of them) that names its draft
  vocabulary: enough to plan the draft's memory and cost, not to run it (load refuses it)."""
  return "draft_vocab_size" in hf and not any((folder / name).is_file() for name in (WEIGHTS, *PICKLES))


def read_meta(folder: pathlib.Path) -> dict:
  """heads.json's fields for an EAGLE-3 folder (either format), from config.json and the
  safetensors header (config.json alone where it holds no weights: _config_alone)."""
  folder = pathlib.Path(folder)
  hf = json.loads((folder / CONFIG).read_text())
  where = str(folder / CONFIG)
  speculators = hf.get("speculators_model_type") == "eagle3"
  layer = dict(hf["transformer_layer_config"]) if speculators else dict(hf)
  for flag in ("norm_before_fc", "fc_norm"):
    if hf.get(flag):
      raise UsageError(f"{where}: {flag}=true is not supported")
  model_type = layer.get("model_type", "llama")
  if model_type not in ("llama", "qwen3"):
    raise UsageError(f"{where}: a draft layer of model_type {model_type!r} is not supported "
                     "(llama, qwen3)")
  draft = ModelConfig.from_hf({**layer, "model_type": model_type, "use_sliding_window": False}, source=where)
  taps = hf.get("eagle_aux_hidden_state_layer_ids") if speculators else None
  if taps is not None and min(taps) < 1:
    raise UsageError(f"{where}: eagle_aux_hidden_state_layer_ids {taps}: layer 0's input (the "
                     "embeddings) is not one of the states a target offers")
  if _config_alone(folder, hf):   # its shapes, before its weights are downloaded (launch.plan_memory)
    draft_vocab = int(hf["draft_vocab_size"])
    reduced = draft_vocab < draft.vocab_size
  else:
    with safetensors.safe_open(_weights(folder), framework="numpy") as f:
      names = set(f.keys())
      head = f.get_slice("lm_head.weight").get_shape() if "lm_head.weight" in names else None
    if head is None:
      raise UsageError(f"{folder / WEIGHTS} lacks lm_head.weight")
    draft_vocab, reduced = int(hf.get("draft_vocab_size", head[0])), "d2t" in names
  return {"kind": "eagle3", "format": "speculators" if speculators else "eagle",
          "hidden_size": draft.hidden_size, "target_vocab_size": draft.vocab_size,
          "checked": list(CHECKED), "draft_vocab_size": draft_vocab, "reduced": reduced,
          # EAGLE-3 numbers a tap by the layer it enters; ours by the layer it leaves
          "aux_layers": None if taps is None else [int(i) for i in taps],
          "norm_before_residual": bool(hf.get("norm_before_residual", False)),
          "norm_output": bool(hf.get("norm_output", False)),
          "draft_config": draft.to_dict()}


def taps(meta: dict, target: ModelConfig) -> tuple[int, ...]:
  """Our taps (layers whose outputs it reads) for its aux layers (whose inputs it reads)."""
  aux = meta["aux_layers"] or [2, target.num_layers // 2, target.num_layers - 3]
  return tuple(i - 1 for i in aux)


def net(meta: dict) -> Eagle3Net:
  return Eagle3Net(3 if meta["aux_layers"] is None else len(meta["aux_layers"]),
                   meta["norm_before_residual"], meta["norm_output"],
                   float(meta["draft_config"]["rms_norm_eps"]))


def load(folder: pathlib.Path, meta: dict, target_config: ModelConfig):
  """(params float32, ReducedVocab or None): every tensor checked, a missing, misshapen or unused
  one named with the file."""
  folder = pathlib.Path(folder)
  weights = _weights(folder)
  c = ModelConfig.from_dict(meta["draft_config"])
  e, aux, v = c.hidden_size, net(meta).aux, meta["draft_vocab_size"]
  with published.Tensors(weights) as tensors:
    take = tensors.take
    layers = tuple(published.decoder_layer(
        tensors, "midlayer." if i == 0 and meta["format"] == "eagle" else f"layers.{i}.", c,
        2 * e if i == 0 else e, FIRST_LAYER_NORMS if i == 0 else None) for i in range(c.num_layers))
    params = {"fc": np.ascontiguousarray(take("fc.weight", (e, aux * e)).T), "norm": take("norm.weight", (e,)),
              "lm_head": np.ascontiguousarray(take("lm_head.weight", (v, e)).T), "layers": layers}
    if tensors.has("embed_tokens.weight"):   # the draft's own copy of its target's embedding
      params["embedding"] = take("embed_tokens.weight", (target_config.vocab_size, e))
    vocab = None
    if meta["reduced"]:
      d2t = take("d2t", (v,), dtype=np.int64)
      if tensors.has("t2d"):
        take("t2d", (target_config.vocab_size,), dtype=None)
      vocab = ReducedVocab(np.concatenate([[-1], np.arange(v) + d2t]).astype(np.int32), target_config.vocab_size)
    tensors.finish("this EAGLE-3 draft does not use")
  return params, vocab
