"""The experiment behind docs/accelerators.md's "Where an H200's step goes" (not part of the library).

Where a Llama-2-7B decode step's time goes on a GPU: the real forward over a 256-slot cache
(weights-bound), and one layer's attention of 1 or 8 tokens over a long context cache, as the
model computes it (`project`), with the values stored [S, D] (`vsd`), and split into 64 blocks
by a reshape (`split64`). Run from the repository's root:

  python docs/results/gpu/gpu_parts.py gpu_parts_h200.json       # OUT=folder for the JSON (default /tmp)
  XLA_FLAGS=--xla_gpu_autotune_level=0 python docs/results/gpu/gpu_parts.py gpu_parts_h200_autotune0.json
"""
import json, math, os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
import jax, jax.numpy as jnp
from hitree_jax.model import llama
from hitree_jax.model.config import ModelConfig
from hitree_jax.decode.timing import median_seconds
from hitree_jax.planner.profile import timed_forward, FORWARDS_PER_CALL
from hitree_jax.cache.full import KVCache

SMALL = os.environ.get("SMALL") == "1"
cfg = ModelConfig.from_dict(dict(vocab_size=32000, hidden_size=4096 if not SMALL else 256,
    intermediate_size=11008 if not SMALL else 512, num_layers=32 if not SMALL else 2,
    num_heads=32 if not SMALL else 4, num_kv_heads=32 if not SMALL else 4, head_dim=128 if not SMALL else 64,
    rope_theta=1e7, max_position_embeddings=131072, dtype="bfloat16"))
CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "4096,32768,131072").split(",")]
out = {"device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}
key = jax.random.key(0, impl="rbg")

def log(k, v):
  out[k] = v; print(k, v, flush=True)

# 1. The real forward over a 256-slot cache: the weights' share.
if os.environ.get("FORWARD", "1") == "1":
  shapes = jax.eval_shape(lambda k: llama.init_params(cfg, k), key)
  leaves, tree = jax.tree.flatten(shapes)
  t = time.time()
  params = jax.jit(lambda k: jax.tree.unflatten(tree, [0.02 * jax.random.normal(kk, s.shape, s.dtype)
      for kk, s in zip(jax.random.split(k, len(leaves)), leaves)]))(key)
  jax.block_until_ready(params); log("params_s", time.time() - t)
  def cache(slots):
    e = KVCache.init(cfg, 1, slots)
    return e.replace(lengths=jnp.full((1,), slots, jnp.int32))
  small = jax.jit(cache, static_argnums=0)(256)
  timed = timed_forward(cfg)
  for w in (1, 8):
    s = median_seconds(timed, params, jnp.zeros((1, w), jnp.int32), small, repeats=10)
    log(f"forward_256_w{w}_ms", 1e3 * s / FORWARDS_PER_CALL)
  del params, small

# 2. Attention of T tokens (32 heads x 128) over a long cache, 8 in a row per program.
def project(q, k, v, lengths):
  t = q.shape[1]
  rk = jnp.zeros((1, k.shape[1], k.shape[2], 8), k.dtype)
  attend = jnp.ones((1, t, 8), bool)
  return llama.attention(q, rk, rk, attend, context=((k, v, lengths),))

def split(q, k, v, lengths, nb=64):
  b, t, h, d = q.shape
  s = k.shape[3]
  rows = q.transpose(0, 2, 1, 3)                        # [B,KVH,R,D] (g = 1)
  kb = k.reshape(b, h, d, nb, s // nb)
  vb = v.reshape(b, h, d, nb, s // nb)
  sc = jnp.einsum("bkrd,bkdnc->bkrnc", rows.astype(k.dtype), kb, preferred_element_type=jnp.float32) / math.sqrt(d)
  m = sc.max(-1)
  p = jnp.exp(sc - m[..., None])
  l = p.sum(-1)
  pv = jnp.einsum("bkdnc,bkrnc->bkrnd", vb, p.astype(v.dtype), preferred_element_type=jnp.float32)
  top = m.max(-1)
  w = jnp.exp(m - top[..., None])
  o = (pv * w[..., None]).sum(-2) / (l * w).sum(-1)[..., None]
  return o.astype(q.dtype).transpose(0, 2, 1, 3)

def vsd(q, k, v_sd, lengths):   # values [B,KVH,S,D]
  b, t, h, d = q.shape
  rows = q.transpose(0, 2, 1, 3)
  sc = jnp.einsum("bkrd,bkds->bkrs", rows.astype(k.dtype), k, preferred_element_type=jnp.float32) / math.sqrt(d)
  p = jax.nn.softmax(sc, axis=-1)
  o = jnp.einsum("bkrs,bksd->bkrd", p.astype(v_sd.dtype), v_sd, preferred_element_type=jnp.float32)
  return o.astype(q.dtype).transpose(0, 2, 1, 3)

def looped(f):
  @jax.jit
  def run(q, k, v, lengths):
    def one(_, q):
      return q + (f(q, k, v, lengths) * 1e-3).astype(q.dtype)
    return jax.lax.fori_loop(0, 8, one, q)
  return run

h, d = cfg.num_kv_heads, cfg.head_dim
for s in CONTEXTS:
  k = jax.jit(lambda kk: jax.random.normal(kk, (1, h, d, s), jnp.bfloat16))(jax.random.fold_in(key, 1))
  v = jax.jit(lambda kk: jax.random.normal(kk, (1, h, d, s), jnp.bfloat16))(jax.random.fold_in(key, 2))
  lengths = jnp.full((1,), s, jnp.int32)
  floor = 2 * k.nbytes / 4.8e12 * 1e3
  log(f"attn_{s}_floor_ms_at_4.8TB_s", floor)
  for w in (1, 8):
    q = jnp.ones((1, w, cfg.num_heads, d), jnp.bfloat16)
    for name, f, vv in (("project", project, v), ("split64", split, v)):
      log(f"attn_{s}_w{w}_{name}_ms", 1e3 * median_seconds(looped(f), q, k, vv, lengths, repeats=10) / 8)
    vt = jnp.swapaxes(v, 2, 3)
    log(f"attn_{s}_w{w}_vsd_ms", 1e3 * median_seconds(looped(vsd), q, k, vt, lengths, repeats=10) / 8)
    del vt
  del k, v
path = os.path.join(os.environ.get("OUT", "/tmp"), sys.argv[1] if len(sys.argv) > 1 else "micro.json")
json.dump(out, open(path, "w"), indent=1)
