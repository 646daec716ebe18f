"""KV cache semantics on a tiny random Llama: incremental decoding, chunked prefill,
commit of an accepted tree path, and dropped (not clamped) out-of-range writes.

Every check compares against one plain causal forward over the whole sequence in a
fresh cache, which is the meaning the cache has to preserve.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax import sharding
from hitree_jax.cache.full import KV_AXES, KVCache, causal_attend, dtypes_of, put_slots, write_slots
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.programs import Programs
from hitree_jax.model import llama as model_lib
from hitree_jax.model.llama import forward
from tests.helpers import CACHE_CONFIG as CONFIG, tiny_params  # shared with tests/test_cache_family.py

ATOL = 1e-5
MAX_LEN = 64  # cache slots in every test: one compiled program per call shape

_forward = jax.jit(forward, static_argnums=1)


def random_tokens(seed, n):
  return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, size=n).astype(np.int32)


def reference(tokens):
  """One causal forward of a single sequence in a fresh cache: (logits [T, V], cache).

  The sequence is right-padded to MAX_LEN (causal, so padding changes nothing before it)
  so that every reference shares one compiled program.
  """
  t = len(tokens)
  padded = np.zeros((1, MAX_LEN), np.int32)
  padded[0, :t] = tokens
  cache = KVCache.init(CONFIG, 1, MAX_LEN)
  logits, _, cache = _forward(tiny_params(), CONFIG, jnp.asarray(padded),
                              jnp.arange(MAX_LEN, dtype=jnp.int32)[None], cache,
                              causal_attend(cache.lengths, MAX_LEN, MAX_LEN))
  return np.asarray(logits[0, :t]), cache


def by_slot(name, x):
  """A cache array (keys or values, stored [B, KVH, D, S]) as [B, KVH, S, D]."""
  del name  # both are stored alike
  return np.swapaxes(np.asarray(x), -1, -2)


def assert_cache_rows_equal(cache, row, ref_cache, n):
  """Slots 0..n-1 of `cache` row `row` equal those of the single-row `ref_cache`."""
  for layer in range(CONFIG.num_layers):
    for name in ("keys", "values"):
      got = by_slot(name, getattr(cache, name)[layer])[row, :, :n]
      want = by_slot(name, getattr(ref_cache, name)[layer])[0, :, :n]
      np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"{name}[{layer}] row {row}")


def test_prefill_then_token_by_token_matches_full_forward():
  params = tiny_params()
  prompt_lens = np.array([7, 12])
  steps = 17
  seqs = [random_tokens(10 + b, int(n) + steps) for b, n in enumerate(prompt_lens)]
  max_len = MAX_LEN
  refs = [reference(s) for s in seqs]

  batch = prefill_lib.make_batch([s[:n] for s, n in zip(seqs, prompt_lens)], CONFIG, steps)
  cache = KVCache.init(CONFIG, 2, max_len)
  logits, cache = prefill_lib.prefill(params, CONFIG, cache, batch, Programs())
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lens)
  for b in range(2):
    np.testing.assert_allclose(np.asarray(logits[b]), refs[b][0][prompt_lens[b] - 1], atol=ATOL)

  for step in range(steps):
    lengths = np.asarray(cache.lengths)
    np.testing.assert_array_equal(lengths, prompt_lens + step)
    tokens = jnp.asarray([[seqs[b][lengths[b]]] for b in range(2)], jnp.int32)
    logits, _, cache = _forward(params, CONFIG, tokens, cache.lengths[:, None], cache,
                                causal_attend(cache.lengths, 1, max_len))
    cache = cache.advance(1)
    for b in range(2):
      np.testing.assert_allclose(np.asarray(logits[b, 0]), refs[b][0][lengths[b]], atol=ATOL,
                                 err_msg=f"row {b} position {lengths[b]}")

  for b in range(2):
    assert_cache_rows_equal(cache, b, refs[b][1], len(seqs[b]))


@pytest.fixture(params=["one_product", "blockwise"])
def context_reads(request, monkeypatch):
  """Both ways a chunk reads the cache before it: one product, or a loop over 8-slot blocks."""
  monkeypatch.setattr(prefill_lib, "MAX_PREFILL_CHUNK", 16)
  if request.param == "blockwise":
    monkeypatch.setattr(model_lib, "CONTEXT_BLOCK", 8)
    monkeypatch.setattr(model_lib, "BLOCKWISE_MIN_ROWS", 1)
  jax.clear_caches()  # programs traced under the other setting must not be reused
  yield Programs()  # programs compiled under this setting, and only those
  jax.clear_caches()


@pytest.mark.parametrize("prompt_len", [50, 48, 5])
def test_chunked_prefill_matches_one_shot(context_reads, prompt_len):
  assert prefill_lib.prefill_chunk_size(prompt_len) == 16  # 50 -> 3 full chunks + a partial one
  prompt = random_tokens(prompt_len, prompt_len)
  max_len = MAX_LEN
  ref_logits, ref_cache = reference(prompt)

  batch = prefill_lib.make_batch([prompt], CONFIG, 1)
  logits, cache = prefill_lib.prefill(tiny_params(), CONFIG, KVCache.init(CONFIG, 1, max_len), batch,
                                     context_reads)
  assert logits.shape == (1, CONFIG.vocab_size)
  np.testing.assert_allclose(np.asarray(logits[0]), ref_logits[-1], atol=ATOL)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [prompt_len])
  assert_cache_rows_equal(cache, 0, ref_cache, prompt_len)


def test_chunked_prefill_batch_of_different_lengths(context_reads):
  prompts = [random_tokens(1, 50), random_tokens(2, 21)]
  max_len = MAX_LEN
  batch = prefill_lib.make_batch(prompts, CONFIG, 1)
  logits, cache = prefill_lib.prefill(tiny_params(), CONFIG, KVCache.init(CONFIG, 2, max_len), batch,
                                     context_reads)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [50, 21])
  for b, prompt in enumerate(prompts):
    ref_logits, ref_cache = reference(prompt)
    np.testing.assert_allclose(np.asarray(logits[b]), ref_logits[-1], atol=ATOL, err_msg=f"row {b}")
    assert_cache_rows_equal(cache, b, ref_cache, prompt.size)
  # The rows' results are really distinct (a row-mixing bug would not go unnoticed).
  assert np.abs(np.asarray(logits[0] - logits[1])).max() > 1e-2


def test_rows_with_one_prompt_are_prefilled_once_each_as_it_alone():
  """Samples of one prompt share its prefill: the chunk program is compiled for the distinct
  prompts' rows, and each row's cache, logits and hidden states are its prompt's."""
  a, b = random_tokens(1, 30), random_tokens(2, 21)
  prompts = [a, b, a, a]
  batch = prefill_lib.make_batch(prompts, CONFIG, 1)
  distinct, index = prefill_lib.distinct_rows(batch)
  assert distinct.batch == 2 and index.tolist() == [0, 1, 0, 0]
  programs = Programs()
  logits, cache, hidden = prefill_lib.prefill(tiny_params(), CONFIG, KVCache.init(CONFIG, 4, MAX_LEN), batch,
                                              programs, all_hidden=True)
  chunks = [key for key in programs._programs if key[0] == "prefill"]
  shapes = [leaf[0] for leaf in chunks[0][2] if isinstance(leaf, tuple) and isinstance(leaf[0], tuple)]
  assert len(chunks) == 1 and (2, prefill_lib.prefill_chunk_size(30)) in shapes   # the tokens of 2 rows
  assert not any(shape[:1] == (4,) for shape in shapes)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [30, 21, 30, 30])
  pair = prefill_lib.prefill(tiny_params(), CONFIG, KVCache.init(CONFIG, 2, MAX_LEN),
                             prefill_lib.make_batch([a, b], CONFIG, 1), Programs(), all_hidden=True)
  for row, prompt in enumerate(prompts):   # each row is its prompt's row of the distinct pair's prefill, bit for bit
    one_logits, one_cache, one_hidden = pair
    first = index[row]
    np.testing.assert_array_equal(np.asarray(logits[row]), np.asarray(one_logits[first]), err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(hidden[row]), np.asarray(one_hidden[first]))
    for ours, theirs in zip((*cache.keys, *cache.values), (*one_cache.keys, *one_cache.values)):
      np.testing.assert_array_equal(np.asarray(ours[row]), np.asarray(theirs[first]))
    ref_logits, ref_cache = reference(prompt)   # and means what its prompt alone means
    np.testing.assert_allclose(np.asarray(logits[row]), ref_logits[-1], atol=ATOL, err_msg=f"row {row}")
    assert_cache_rows_equal(cache, row, ref_cache, prompt.size)


# A candidate block of T=5 tokens written after the committed prefix. parent -1 is the
# prefix; the path 0 -> 2 -> 3 is one branch, 1 (a second root) and 4 (a child of 0,
# sibling of 2) are elsewhere in the tree.
PARENTS = [-1, -1, 0, 2, 0]


def ancestors_or_self(i):
  out = []
  while i != -1:
    out.append(i)
    i = PARENTS[i]
  return out


def depth(i):
  return len(ancestors_or_self(i)) - 1


def tree_attend(lengths, max_len):
  """[B, T, S]: candidate i sees the committed prefix of its row plus its ancestors and itself."""
  t = len(PARENTS)
  attend = np.zeros((len(lengths), t, max_len), bool)
  for b, n in enumerate(lengths):
    for i in range(t):
      attend[b, i, :n] = True
      for j in ancestors_or_self(i):
        attend[b, i, n + j] = True
  return jnp.asarray(attend)


def test_commit_accepted_tree_path_matches_direct_run():
  params = tiny_params()
  max_len = MAX_LEN
  prompts = [random_tokens(21, 9), random_tokens(22, 14), random_tokens(23, 5)]
  # Candidate tokens per row, all distinct within a row.
  candidates = np.array([[3, 17, 29, 41, 53], [8, 19, 30, 44, 57], [5, 11, 23, 37, 59]], np.int32)
  # Accepted paths (candidate indices, in order) and how many are committed per row.
  paths = np.array([[0, 2, 3], [0, 4, 1], [1, 0, 0]])  # beyond n_accepted: arbitrary padding
  n_accepted = np.array([3, 2, 1])
  next_tokens = np.array([7, 13, 31], np.int32)

  batch = prefill_lib.make_batch(prompts, CONFIG, 8)
  _, cache = prefill_lib.prefill(params, CONFIG, KVCache.init(CONFIG, 3, max_len), batch, Programs())
  lengths = np.array([p.size for p in prompts])

  positions = lengths[:, None] + np.array([depth(i) for i in range(len(PARENTS))])[None, :]
  tree_logits, _, cache = _forward(params, CONFIG, jnp.asarray(candidates),
                                   jnp.asarray(positions, jnp.int32), cache,
                                   tree_attend(lengths, max_len))
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)  # forward does not advance

  slots = jnp.asarray(lengths[:, None] + paths, jnp.int32)
  cache = cache.commit(slots, jnp.asarray(n_accepted, jnp.int32))
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + n_accepted)

  next_logits, _, _ = _forward(params, CONFIG, jnp.asarray(next_tokens)[:, None],
                               cache.lengths[:, None], cache,
                               causal_attend(cache.lengths, 1, max_len))
  for b in range(3):
    path = paths[b, :n_accepted[b]]
    direct = np.concatenate([prompts[b], candidates[b, path], next_tokens[b:b + 1]])
    ref_logits, ref_cache = reference(direct)
    committed = lengths[b] + n_accepted[b]
    # Each candidate on the path saw exactly prefix + its ancestors.
    for d, i in enumerate(path):
      np.testing.assert_allclose(np.asarray(tree_logits[b, i]), ref_logits[lengths[b] + d],
                                 atol=ATOL, err_msg=f"row {b} candidate {i}")
    assert_cache_rows_equal(cache, b, ref_cache, committed)
    np.testing.assert_allclose(np.asarray(next_logits[b, 0]), ref_logits[committed], atol=ATOL,
                               err_msg=f"row {b} next token")

  # The comparison can tell paths apart: committing sibling 4 instead of 2 (row 0)
  # would give different next-token logits.
  wrong = np.concatenate([prompts[0], candidates[0, [0, 4, 3]], next_tokens[:1]])
  right = np.concatenate([prompts[0], candidates[0, [0, 2, 3]], next_tokens[:1]])
  assert np.abs(reference(wrong)[0][-1] - reference(right)[0][-1]).max() > 1e-2


def test_forward_writes_past_the_end_are_dropped():
  params = tiny_params()
  max_len = MAX_LEN
  # Fill every slot of both rows with real keys/values.
  tokens = np.stack([random_tokens(31, max_len), random_tokens(32, max_len)])
  cache = KVCache.init(CONFIG, 2, max_len)
  _, _, full = _forward(params, CONFIG, jnp.asarray(tokens),
                        jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (2, max_len)), cache,
                        causal_attend(cache.lengths, max_len, max_len))

  new = jnp.asarray([[4, 9, 16], [25, 36, 49]], jnp.int32)
  write_at = jnp.asarray([max_len - 1, max_len - 2], jnp.int32)
  positions = write_at[:, None] + jnp.arange(3, dtype=jnp.int32)[None, :]
  attend = causal_attend(write_at, 3, max_len)
  _, _, after = _forward(params, CONFIG, new, positions, full, attend, write_at)

  # What the in-range new tokens alone would have written (row 0: one, row 1: two).
  _, _, one = _forward(params, CONFIG, new[:, :1], positions[:, :1], full,
                       causal_attend(write_at, 1, max_len), write_at)
  _, _, two = _forward(params, CONFIG, new[:, :2], positions[:, :2], full,
                       causal_attend(write_at, 2, max_len), write_at)
  # What row 0's third (out-of-range) token would put in slot S-1 if it were clamped there.
  _, _, clamped = _forward(params, CONFIG, new[:, 2:], positions[:, 2:], full,
                           causal_attend(write_at, 1, max_len), write_at)
  for layer in range(CONFIG.num_layers):
    for name in ("keys", "values"):
      got = by_slot(name, getattr(after, name)[layer])
      old = by_slot(name, getattr(full, name)[layer])
      np.testing.assert_array_equal(got[0, :, :max_len - 1], old[0, :, :max_len - 1])
      np.testing.assert_array_equal(got[1, :, :max_len - 2], old[1, :, :max_len - 2])
      want_one = by_slot(name, getattr(one, name)[layer])
      want_two = by_slot(name, getattr(two, name)[layer])
      np.testing.assert_allclose(got[0, :, max_len - 1], want_one[0, :, max_len - 1], atol=ATOL)
      np.testing.assert_allclose(got[1, :, max_len - 2:], want_two[1, :, max_len - 2:], atol=ATOL)
      # and a clamped write of the dropped token would really have shown
      clamp = by_slot(name, getattr(clamped, name)[layer])[0, :, max_len - 1]
      assert np.abs(got[0, :, max_len - 1] - clamp).max() > 1e-3


def reference_put(buffer, block, start):
  """put_slots in numpy, slot by slot: block slot i goes to start[b] + i where that is a slot."""
  out = buffer.copy()
  for b in range(buffer.shape[0]):
    for i in range(block.shape[3]):
      if 0 <= start[b] + i < buffer.shape[3]:
        out[b, :, :, start[b] + i] = block[b, :, :, i]
  return out


@pytest.mark.parametrize("width", [4, 16, 40])   # a block narrower than a shard, than the buffer, wider
def test_put_slots_writes_in_place_what_a_dropping_scatter_writes(width):
  """One dynamic_update_slice per row (what a TPU updates in place), at any start -- inside, past
  the end, before the first slot -- and, on a cache split by slot over 2 devices, each device
  writing its own slots: the same as slot-by-slot writes that drop what falls outside."""
  rng = np.random.default_rng(width)
  buffer = rng.standard_normal((2, 4, 3, 32)).astype(np.float32)   # [B, KVH, D, S]
  block = rng.standard_normal((2, 4, 3, width)).astype(np.float32)
  mesh = sharding.make_mesh("sequence:2,model:2")
  split = jax.device_put(buffer, sharding.named(mesh, KV_AXES))
  for start in ([0, 5], [14, 30], [28, 31], [-3, 40], [-width - 1, 16]):
    want = reference_put(buffer, block, start)
    got = put_slots(jnp.asarray(buffer), jnp.asarray(block), jnp.asarray(start, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), want)
    with sharding.use(mesh):
      on_shards = jax.jit(functools.partial(put_slots, shards=2))(split, jnp.asarray(block),
                                                                  jnp.asarray(start, jnp.int32))
    np.testing.assert_array_equal(np.asarray(on_shards), want)


def test_write_slots_and_commit_drop_out_of_range():
  rng = np.random.default_rng(0)
  buf = jnp.asarray(rng.standard_normal((2, 2, 8, 4)), jnp.float32)
  new = jnp.asarray(rng.standard_normal((2, 3, 2, 4)), jnp.float32)
  # buf [B, KVH, S, D] here, the cache's [B, KVH, D, S] by slot
  out = by_slot("keys", write_slots(jnp.swapaxes(buf, -1, -2), new, jnp.asarray([7, 2], jnp.int32)))
  np.testing.assert_array_equal(out[0, :, :7], np.asarray(buf)[0, :, :7])
  np.testing.assert_array_equal(out[0, :, 7], np.asarray(new)[0, 0])
  np.testing.assert_array_equal(out[1, :, 2:5], np.asarray(new)[1].transpose(1, 0, 2))
  np.testing.assert_array_equal(np.delete(out[1], [2, 3, 4], axis=1),
                                np.delete(np.asarray(buf)[1], [2, 3, 4], axis=1))

  # commit: row 0 has room for 2 of its 3 gathered slots; the 3rd must not clamp onto slot 7.
  cache = KVCache(keys=(jnp.swapaxes(buf, -1, -2),), values=(jnp.swapaxes(buf * 2, -1, -2),),
                  lengths=jnp.asarray([6, 1], jnp.int32))
  slots = jnp.asarray([[0, 1, 2], [5, 6, 7]], jnp.int32)
  done = cache.commit(slots, jnp.asarray([2, 3], jnp.int32))
  np.testing.assert_array_equal(np.asarray(done.lengths), [8, 4])
  b = np.asarray(buf)
  for got, scale in ((by_slot("keys", done.keys[0]), 1), (by_slot("values", done.values[0]), 2)):
    np.testing.assert_array_equal(got[0, :, :6], scale * b[0, :, :6])
    np.testing.assert_array_equal(got[0, :, 6:8], scale * b[0, :, 0:2])
    np.testing.assert_array_equal(got[1, :, :1], scale * b[1, :, :1])
    np.testing.assert_array_equal(got[1, :, 1:4], scale * b[1, :, 5:8])
    np.testing.assert_array_equal(got[1, :, 4:], scale * b[1, :, 4:])


def test_causal_attend_mask():
  # Every test above builds its reference with causal_attend, so pin it down explicitly.
  got = np.asarray(causal_attend(jnp.asarray([0, 3], jnp.int32), 2, 6))
  want = np.array([[[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]],
                   [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]], bool)
  np.testing.assert_array_equal(got, want)


def test_a_config_stores_keys_in_its_key_dtype_and_a_forward_reads_them():
  """ModelConfig.key_dtype: caches built from the config keep keys in it and values in `dtype`;
  a forward's logits then move from float32 keys' by a bfloat16 rounding, not more and not less
  (so the setting reaches the product)."""
  config = CONFIG.replace(key_dtype="bfloat16")
  cache = KVCache.init(config, 1, MAX_LEN)
  assert cache.keys[0].dtype == jnp.bfloat16 and cache.values[0].dtype == jnp.float32
  assert KVCache.init(CONFIG, 1, 4, **dtypes_of(cache)).keys[0].dtype == jnp.bfloat16
  tokens = random_tokens(3, 40)
  padded = jnp.zeros((1, MAX_LEN), jnp.int32).at[0, :40].set(tokens)
  positions = jnp.arange(MAX_LEN, dtype=jnp.int32)[None]
  attend = causal_attend(cache.lengths, MAX_LEN, MAX_LEN)
  logits, _, cache = _forward(tiny_params(), config, padded, positions, cache, attend)
  assert cache.keys[0].dtype == jnp.bfloat16
  want = reference(tokens)[0]
  error = np.max(np.abs(np.asarray(logits[0, :40]) - want))
  assert 1e-4 < error < 0.05 * np.max(np.abs(want)), error


def test_a_bad_key_dtype_is_named_and_the_models_own_is_no_change():
  with pytest.raises(ValueError, match="key_dtype='float16'"):
    CONFIG.replace(key_dtype="float16")
  assert CONFIG.replace(key_dtype="float32") == CONFIG


@pytest.mark.parametrize("slots", [100, 512])   # one product over the whole buffer; a block loop
def test_a_context_seen_from_its_start_is_exactly_its_slots_from_there(slots):
  """attention() with a context (k, v, lengths, start): every query sees the context's slots
  [start, length) and no others, as a softmax over them and its own keys written out by hand;
  64 rows (32 tokens x 2 query heads per KV head) take the block loop over 512 slots."""
  rng = np.random.default_rng(slots)
  b, t, h, kvh, d = 2, 32, 4, 2, 8
  q = rng.standard_normal((b, t, h, d)).astype(np.float32)
  own_k, own_v = (rng.standard_normal((b, kvh, d, t)).astype(np.float32) for _ in range(2))
  ctx_k, ctx_v = (rng.standard_normal((b, kvh, d, slots)).astype(np.float32) for _ in range(2))
  lengths, start = np.array([slots - 7, 60], np.int32), np.array([1, 0], np.int32)
  assert t * (h // kvh) >= model_lib.BLOCKWISE_MIN_ROWS
  got = np.asarray(model_lib.attention(q, own_k, own_v, np.ones((b, t, t), bool),
                                       ((ctx_k, ctx_v, lengths, start),)))
  for row in range(b):
    seen = slice(start[row], lengths[row])
    keys = np.concatenate([own_k[row], ctx_k[row][..., seen]], axis=-1)        # [KVH, D, T + n]
    values = np.concatenate([own_v[row], ctx_v[row][..., seen]], axis=-1)
    for head in range(h):
      scores = q[row, :, head] @ keys[head // (h // kvh)] / np.sqrt(d)         # [T, T + n]
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      weights /= weights.sum(-1, keepdims=True)
      np.testing.assert_allclose(got[row, :, head], weights @ values[head // (h // kvh)].T, atol=2e-5, rtol=1e-4)
  no_start = model_lib.attention(q, own_k, own_v, np.ones((b, t, t), bool), ((ctx_k, ctx_v, lengths),))
  from_zero = model_lib.attention(q, own_k, own_v, np.ones((b, t, t), bool),
                                  ((ctx_k, ctx_v, lengths, np.zeros(b, np.int32)),))
  np.testing.assert_allclose(np.asarray(no_start), np.asarray(from_zero), atol=1e-6)
