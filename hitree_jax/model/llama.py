"""A pure-functional Flax (linen) Llama; also Mistral's, Qwen2's and Qwen3's decoder
(ModelConfig.from_hf: Qwen2 adds biases to q/k/v, Qwen3 norms each head's query and key, a
Mistral's sliding window caps its positions).

The model knows nothing about speculation. One call takes T new tokens with
explicit positions, writes their keys/values into the cache at explicit slots,
and attends under an explicit boolean mask over all cache slots, so a token
tree is just another mask. Parameter names mirror Hugging Face's
(`embed_tokens`, `layers_i/self_attn/q_proj`, ...) to keep loaders trivial;
layers are separate submodules in a Python loop, not a scan over stacked
weights, which decodes ~1.7x faster on XLA:CPU.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import SLOT_AXIS, KVCache, dtypes_of, slot_shards, write_slots
from hitree_jax.cache.rope import apply_rope, rope_cos_sin
from hitree_jax.model.config import ModelConfig

_MASKED = -1e30


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse frequencies [D/2], with HF's `linear` and `llama3` scaling, then divided by a
  GGUF's per-frequency factors (config.rope_freq_factors) where it has them."""
  return _inv_freq(config).astype(np.float32)


def rope_freq_factors(config: ModelConfig) -> np.ndarray | None:
  """What a GGUF stores as llama.cpp's `rope_freqs` [D/2] (float32) for this config: the factors
  that divide the unscaled inverse frequencies, for `llama3` scaling (which GGUF has no key for)
  or factors loaded from a GGUF; None when there are none (no scaling, or linear: a key)."""
  kind = config.rope_scaling_dict.get("rope_type", config.rope_scaling_dict.get("type"))
  if kind != "llama3" and config.rope_freq_factors is None:
    return None
  unscaled = config.replace(rope_scaling=None if kind == "llama3" else config.rope_scaling,
                            rope_freq_factors=None)
  return (_inv_freq(unscaled) / _inv_freq(config)).astype(np.float32)


def _inv_freq(config: ModelConfig) -> np.ndarray:
  d = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  scaling = config.rope_scaling_dict
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "linear":
    inv_freq = inv_freq / scaling["factor"]
  elif kind == "llama3":
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(medium, smoothed, scaled)
  if config.rope_freq_factors is not None:
    inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float64)
  return inv_freq


# Context caches are read in blocks of this many slots (a divisor of the cache
# bucket) when many rows attend at once (prefill); a few rows (decoding) read
# the whole buffer in one product, which measured faster than a block loop.
CONTEXT_BLOCK = 256
BLOCKWISE_MIN_ROWS = 64


def _scores(rows, k, scale):
  """rows [B,KVH,R,D] . keys k [B,KVH,D,S] -> [B,KVH,R,S] float32: the rows are rounded to the keys'
  dtype (ModelConfig.key_dtype), the product accumulates in float32."""
  return jnp.einsum("bkrd,bkds->bkrs", rows.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale


def _merge(stats, scores, v):
  """Folds one block of scores [B,KVH,R,S] (values v [B,KVH,D,S]) into running softmax stats."""
  m, l, acc = stats
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
  p = jnp.exp(scores - m_new[..., None])
  decay = jnp.exp(m - m_new)
  # Values [D, S] (KVCache says why) on the left: XLA:CPU decodes SmolLM2 at 2K tokens as fast as
  # it did with values [S, D] (31 tok/s), where "bkrs,bkds->bkrd" ran at 26 (docs/accelerators.md).
  pv = jnp.einsum("bkds,bkrs->bkdr", v, p.astype(v.dtype), preferred_element_type=jnp.float32)
  acc = acc * decay[..., None] + jnp.swapaxes(pv, -1, -2)
  return m_new, l * decay + jnp.sum(p, axis=-1), acc


def merge_stats(a, b):
  """Two online-softmax states (max [B,KVH,R], sum [B,KVH,R], accumulator [B,KVH,R,D]) of
  disjoint slots -> the state of their union: exact, whatever split made them."""
  (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
  m = jnp.maximum(m_a, m_b)
  w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
  return m, l_a * w_a + l_b * w_b, acc_a * w_a[..., None] + acc_b * w_b[..., None]


def _empty_stats(rows):
  return (jnp.full(rows.shape[:3], _MASKED, jnp.float32), jnp.zeros(rows.shape[:3], jnp.float32),
          jnp.zeros(rows.shape, jnp.float32))


def _visible(slots, lengths, start):
  """[B, S] slots (sequence positions of a buffer [S]) in [start[b], lengths[b]); start None: 0."""
  visible = slots[None, :] < lengths[:, None]
  return visible if start is None else visible & (slots[None, :] >= start[:, None])


def _context_blocks(rows, k_buf, v_buf, lengths, stats, scale, start=None):
  """Attends rows [B,KVH,R,D] to the committed slots [0, lengths[b]) of a read-only cache (from
  start[b] on, where given: slots before it hold nothing).

  Only the blocks holding committed slots are read (a dynamic trip count), so a
  prefill chunk early in a long prompt does not pay for the whole buffer. A
  cache split by slot over devices is read shard by shard, each device its own
  slots, and the shards' softmax states merged (a block at a dynamic offset of
  a split axis would make XLA gather the whole cache on every device).
  """
  size = k_buf.shape[3]
  if rows.shape[2] < BLOCKWISE_MIN_ROWS or size % CONTEXT_BLOCK:
    scores = _scores(rows, k_buf, scale)
    visible = _visible(jnp.arange(size), lengths, start)
    return _merge(stats, jnp.where(visible[:, None, None, :], scores, _MASKED), v_buf)
  shards = slot_shards()
  if shards > 1 and size % shards == 0:
    return merge_stats(stats, _per_slot_shard(rows, k_buf, v_buf, lengths, scale, start))
  return _block_loop(rows, k_buf, v_buf, lengths, stats, scale, CONTEXT_BLOCK, start)


def _per_slot_shard(rows, k_buf, v_buf, lengths, scale, start=None):
  """_block_loop on each `sequence` shard's slots (shard_map, the other mesh axes left to the
  partitioner), then the shards' states merged by their maximum: one max and two sums across
  devices per call, and no device reads another's slots."""
  spec = jax.sharding.PartitionSpec

  def per_shard(rows, k_buf, v_buf, lengths, start, first_slot):
    local = k_buf.shape[3]
    mine = jnp.clip(lengths - first_slot[0], 0, local)
    block = math.gcd(local, CONTEXT_BLOCK)  # blocks must tile the shard: none may overlap
    m, l, acc = _block_loop(rows, k_buf, v_buf, mine, _empty_stats(rows), scale, block,
                            jnp.clip(start - first_slot[0], 0, local))
    top = jax.lax.pmax(m, SLOT_AXIS)
    w = jnp.exp(m - top)
    return top, jax.lax.psum(l * w, SLOT_AXIS), jax.lax.psum(acc * w[..., None], SLOT_AXIS)

  shards = slot_shards()
  first_slots = jnp.arange(shards) * (k_buf.shape[3] // shards)  # [shards]: each shard's first slot
  return jax.shard_map(per_shard, mesh=jax.sharding.get_abstract_mesh(),
                       in_specs=(spec(), spec(None, None, None, SLOT_AXIS), spec(None, None, None, SLOT_AXIS),
                                 spec(), spec(), spec(SLOT_AXIS)),
                       out_specs=spec(), axis_names={SLOT_AXIS}, check_vma=False)(
                           rows, k_buf, v_buf, lengths, jnp.zeros_like(lengths) if start is None else start,
                           first_slots)


def _block_loop(rows, k_buf, v_buf, lengths, stats, scale, block: int, start=None):
  """The blocks of `block` slots (a divisor of the buffer's) up to the longest row's committed
  length, one at a time (slots before start [B], where given, masked)."""
  n_blocks = (jnp.max(lengths) + block - 1) // block

  def body(i, stats):
    k = jax.lax.dynamic_slice_in_dim(k_buf, i * block, block, axis=3)
    v = jax.lax.dynamic_slice_in_dim(v_buf, i * block, block, axis=3)
    scores = _scores(rows, k, scale)
    visible = _visible(i * block + jnp.arange(block), lengths, start)  # [B, block]
    return _merge(stats, jnp.where(visible[:, None, None, :], scores, _MASKED), v)

  return jax.lax.fori_loop(0, n_blocks, body, stats)


def attention(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, attend: jax.Array,
              context=()) -> jax.Array:
  """Grouped-query attention over a cache under an explicit mask, plus read-only context caches.

  q [B,T,H,D]; k_buf, v_buf [B,KVH,D,S] with attend [B,T,S] bool; context:
  (k_buf, v_buf, lengths [B]) caches whose committed slots every query sees, or (k_buf, v_buf,
  lengths, start [B]) seen from slot start[b] on.
  One online softmax spans all of them, so splitting a cache is exact.
  The query heads sharing a KV head and the T new tokens are folded into one
  row axis, so products are plain batched matmuls over (B, KVH) with caches in
  their stored layout (3x faster on XLA:CPU than keeping the axes apart).
  """
  b, t, h, d = q.shape
  kvh = k_buf.shape[1]
  g = h // kvh
  scale = 1.0 / math.sqrt(d)
  rows = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
  scores = _scores(rows, k_buf, scale)
  mask = jnp.broadcast_to(attend[:, None, None], (b, 1, g, t, attend.shape[-1]))
  scores = jnp.where(mask.reshape(b, 1, g * t, -1), scores, _MASKED)
  stats = _merge(_empty_stats(rows), scores, v_buf)
  for ctx_k, ctx_v, ctx_lengths, *start in context:
    stats = _context_blocks(rows, ctx_k, ctx_v, ctx_lengths, stats, scale, *start)
  _, l, acc = stats
  out = (acc / l[..., None]).astype(q.dtype)
  return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


# The logical axes (sharding.py) of every parameter, by the names the modules below give them:
# the module's, then the parameter's. Projections split whole heads, the MLP's width or the
# vocabulary; norms run along the model's width. A parameter not declared here is refused.
PARAM_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_proj", "kernel"): ("embed", "heads"),      # [E, H * D]: whole heads per shard
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("q_proj", "bias"): ("heads",),                # [H * D]: with the kernel's heads (qkv_bias)
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "bias"): ("embed",),                # o_bias
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("q_norm", "weight"): ("head_dim",),          # Qwen3's per-head norms (qk_norm)
    ("k_norm", "weight"): ("head_dim",),
    ("input_layernorm", "weight"): ("embed",),
    ("post_attention_layernorm", "weight"): ("embed",),
    ("norm", "weight"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}


def rms_norm(x, weight, eps: float, dtype=None):
  """RMSNorm over the last axis, computed in float32, the weight applied in `dtype` (x's)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(dtype or x.dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
    return rms_norm(x, weight, self.eps, self.dtype)


def _dense(features: int, name: str, dtype, bias: bool = False) -> nn.Dense:
  return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name)


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, attend, k_buf, v_buf, write_at, context=()):
    """x [B,T,E]; k_buf, v_buf [B,KVH,D,S] (written at write_at [B]);
    context: read-only (k, v, lengths) caches whose committed slots all queries see; attend [B,T,S]."""
    c = self.config
    dtype = jnp.dtype(c.dtype)
    b, t, _ = x.shape

    def project(heads, name):  # x [B,T,E] -> [B,T,heads,D]
      return _dense(heads * c.head_dim, name, dtype, c.qkv_bias)(x).reshape(b, t, heads, c.head_dim)

    q = project(c.num_heads, "q_proj")
    k, v = project(c.num_kv_heads, "k_proj"), project(c.num_kv_heads, "v_proj")
    if c.qk_norm:  # Qwen3: each head's query and key normalised over its D
      q = RMSNorm(c.rms_norm_eps, dtype, name="q_norm")(q)
      k = RMSNorm(c.rms_norm_eps, dtype, name="k_norm")(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_buf = write_slots(k_buf, k, write_at)
    v_buf = write_slots(v_buf, v, write_at)

    out = attention(q, k_buf, v_buf, attend, context).reshape(b, t, c.num_heads * c.head_dim)
    return _dense(c.hidden_size, "o_proj", dtype, c.o_bias)(out), k_buf, v_buf


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c, dtype = self.config, jnp.dtype(self.config.dtype)
    gate = _dense(c.intermediate_size, "gate_proj", dtype)(x)
    up = _dense(c.intermediate_size, "up_proj", dtype)(x)
    return _dense(c.hidden_size, "down_proj", dtype)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, attend, k_buf, v_buf, write_at, context=()):
    c, dtype = self.config, jnp.dtype(self.config.dtype)
    h, k_buf, v_buf = Attention(c, name="self_attn")(
        RMSNorm(c.rms_norm_eps, dtype, name="input_layernorm")(x),
        cos, sin, attend, k_buf, v_buf, write_at, context)
    x = x + h
    x = x + MLP(c, name="mlp")(RMSNorm(c.rms_norm_eps, dtype, name="post_attention_layernorm")(x))
    return x, k_buf, v_buf


class Llama(nn.Module):
  """Llama decoder. `__call__` returns final-normed hidden states; `logits` maps them to the vocabulary."""
  config: ModelConfig

  def setup(self):
    c, dtype = self.config, jnp.dtype(self.config.dtype)
    self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype,
                                 embedding_init=nn.initializers.normal(0.02))
    self.layers = [DecoderLayer(c) for _ in range(c.num_layers)]  # named layers_0..N-1
    self.norm = RMSNorm(c.rms_norm_eps, dtype)
    if not c.tie_word_embeddings:
      self.lm_head = _dense(c.vocab_size, "lm_head", dtype)

  def __call__(self, tokens, positions, attend, keys, values, write_at, context=(), taps=()):
    """tokens, positions [B,T]; keys/values: per-layer [B,KVH,D,S], written at write_at [B];
    context: read-only caches, each (per-layer keys, per-layer values, lengths [B]); attend [B,T,S].
    taps: layers whose outputs (the residual stream) come before the final-normed states in the
    returned hidden [B,T,(len(taps)+1)E] (what an EAGLE-3 draft reads: heads/eagle.py)."""
    x = self.embed_tokens(tokens)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(self.config))                  # [B,T,D]
    new_keys, new_values, tapped = [], [], []
    for i, (layer, k_buf, v_buf) in enumerate(zip(self.layers, keys, values)):
      layer_context = tuple((ks[i], vs[i], lengths) for ks, vs, lengths in context)
      x, k_buf, v_buf = layer(x, cos, sin, attend, k_buf, v_buf, write_at, layer_context)
      new_keys.append(k_buf)
      new_values.append(v_buf)
      if i in taps:
        tapped.append(x)
    hidden = self.norm(x)
    if tapped:
      hidden = jnp.concatenate([*tapped, hidden.astype(x.dtype)], axis=-1)
    return hidden, tuple(new_keys), tuple(new_values)

  def logits(self, hidden):
    """hidden [..., E] -> float32 logits [..., V]."""
    if self.config.tie_word_embeddings:
      out = self.embed_tokens.attend(hidden)
    else:
      out = self.lm_head(hidden)
    return out.astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def llama(config: ModelConfig) -> Llama:
  return Llama(config)


def init_params(config: ModelConfig, key: jax.Array) -> dict:
  """Random parameters (for tests and for training a draft from scratch)."""
  cache = KVCache.init(config, 1, 1)
  tokens = jnp.zeros((1, 1), jnp.int32)
  model = llama(config)

  def init_all(m):
    m(tokens, tokens, jnp.ones((1, 1, 1), bool), cache.keys, cache.values, cache.lengths)
    return m.logits(jnp.zeros((1, config.hidden_size), jnp.dtype(config.dtype)))

  return nn.init(init_all, model)(key)["params"]


def hidden_states(params, config: ModelConfig, tokens, positions, cache: KVCache, attend,
                  write_at=None, context: tuple[KVCache, ...] = (), taps: tuple[int, ...] = ()):
  """Runs T new tokens through the model; returns (hidden [B,T,E], cache); with taps, hidden
  [B,T,(len(taps)+1)E] holds those layers' outputs before the final-normed states (Llama).

  Keys/values of the new tokens are written into `cache` at slots
  write_at[b] + 0..T-1 (default: its committed length). The committed length
  is NOT advanced: the caller decides what to keep (`advance` or `commit`).
  `attend` [B, T, S] is the explicit mask over the slots of `cache`. Each
  `context` cache is read-only and every new token sees exactly its committed
  slots. Keeping a long cache read-only while new tokens go to a short one
  spares XLA:CPU a copy of every layer's long cache per step (decode/levels.py).
  """
  if write_at is None:
    write_at = cache.lengths
  hidden, keys, values = llama(config).apply(
      {"params": params}, tokens, positions, attend, cache.keys, cache.values, write_at,
      tuple((c.keys, c.values, c.lengths) for c in context), tuple(taps))
  return hidden, cache.replace(keys=keys, values=values)


def logits_from_hidden(params, config: ModelConfig, hidden):
  """hidden [..., E] -> float32 logits [..., V]."""
  if config.tie_word_embeddings and "lm_head" in params:  # with_decode_head's copy
    return jnp.dot(hidden, params["lm_head"]["kernel"]).astype(jnp.float32)
  return llama(config).apply({"params": params}, hidden, method=Llama.logits)


def last_token_projections(params, config: ModelConfig, full: KVCache, last_tokens: jax.Array,
                           names: tuple[str, ...] = ("q_proj",)) -> dict[str, jax.Array]:
  """Post-RoPE projections {name: [L, B, heads, D]} of each row's last committed token.

  Reruns last_tokens [B] (the tokens at slots lengths-1) at their positions,
  seeing the full cache's slots before them as read-only context and their own
  key through a 1-slot cache, i.e. exactly the computation prefill did for
  them (TriForce's retrieval scores the cache's chunks with these queries: cache/retrieval.py).
  `q_proj`/`k_proj` outputs are captured with flax's capture_intermediates, by the module names
  this file gives them.
  """
  batch = full.batch
  position = jnp.maximum(full.lengths - 1, 0)[:, None]                  # [B, 1]
  own = KVCache.init(config, batch, 1, **dtypes_of(full))
  context = ((full.keys, full.values, position[:, 0]),)
  wanted = lambda module, method: method == "__call__" and module.name in names
  _, state = llama(config).apply(
      {"params": params}, last_tokens[:, None].astype(jnp.int32), position,
      jnp.ones((batch, 1, 1), bool), own.keys, own.values, own.lengths, context,
      capture_intermediates=wanted, mutable=["intermediates"])
  captured = state["intermediates"]
  out = {}
  for name in names:
    per_layer = []
    for i in range(config.num_layers):
      x = captured[f"layers_{i}"]["self_attn"][name]["__call__"][0]     # [B, 1, heads * D]
      x = x.reshape(batch, 1, -1, config.head_dim)
      per_layer.append(apply_rope(x, *rope_cos_sin(position, rope_inv_freq(config)))[:, 0])                 # [B, heads, D]
    out[name] = jnp.stack(per_layer)
  return out


def with_decode_head(params, config: ModelConfig) -> dict:
  """Adds a tied model's output head as an [E, V] `lm_head` kernel (the embedding's transpose).

  XLA:CPU multiplies a few rows (a speculative round's tree) by an [E, V]
  kernel 2-8x faster than by the [V, E] embedding it would otherwise read
  transposed; the price is one more copy of the embedding in memory.
  `without_decode_head` drops it again before weights are saved.
  """
  if not config.tie_word_embeddings or "lm_head" in params:
    return params
  return dict(params, lm_head={"kernel": jnp.asarray(params["embed_tokens"]["embedding"]).T.copy()})


def without_decode_head(params, config: ModelConfig) -> dict:
  if not config.tie_word_embeddings:
    return params
  return {name: value for name, value in params.items() if name != "lm_head"}


def final_states(hidden, config: ModelConfig):
  """The final-normed states [..., E] of hidden_states' output (the last E of its taps)."""
  width = hidden.shape[-1]
  return hidden if width == config.hidden_size else hidden[..., width - config.hidden_size:]


def forward(params, config: ModelConfig, tokens, positions, cache: KVCache, attend,
            write_at=None, context: tuple[KVCache, ...] = (), taps: tuple[int, ...] = ()):
  """(logits [B,T,V] float32, hidden [B,T,E] (or with taps: hidden_states), cache)."""
  hidden, cache = hidden_states(params, config, tokens, positions, cache, attend, write_at, context, taps)
  return logits_from_hidden(params, config, final_states(hidden, config)), hidden, cache
