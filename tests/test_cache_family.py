"""The retrieval (TriForce) and StreamingLLM caches on tiny random models and synthetic caches.

Selections are checked against plain-numpy references; attention through each
cache as a read-only `context` is checked against the full cache (a budget or
window covering the context is exact) or against the full cache under the
equivalent explicit mask. Every entry point runs under jax.jit and a second
call with new values must compile nothing.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.cache import retrieval
from hitree_jax.decode import retrieve
from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.cache.retrieval import RetrievalCache
from hitree_jax.cache.streaming import StreamingCache
from hitree_jax.model import llama as llama_lib
from hitree_jax.model.llama import forward
from tests.helpers import CACHE_CONFIG as CONFIG, tiny_params  # test_kv_cache's tiny model and weights

MAX_LEN = 64
CHUNK = 8
ATOL = 1e-5

_forward = jax.jit(forward, static_argnums=1)
_select = jax.jit(retrieval.select, static_argnames=("budget", "chunk", "tail"))
_from_full = jax.jit(retrieve.from_full, static_argnums=(1,), static_argnames=("budget", "chunk", "tail"))
_reselect = jax.jit(retrieve.from_full, static_argnums=(1,), static_argnames=("budget", "chunk", "tail"))
_projections = jax.jit(llama_lib.last_token_projections, static_argnums=(1, 4))
_from_prefill = jax.jit(StreamingCache.from_prefill, static_argnums=(1, 2))
_stream_append = jax.jit(StreamingCache.append)


class CompileCounter:
  """Counts XLA backend compilations while alive in a `with` block."""

  def __init__(self):
    self.count = 0
    self.active = False
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event, duration, **kwargs):
    if self.active and event == "/jax/core/compile/backend_compile_duration":
      self.count += 1

  def __enter__(self):
    self.active = True
    return self

  def __exit__(self, *exc):
    self.active = False


def random_sequences(seed, batch):
  return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, MAX_LEN)).astype(np.int32)


def prefill(sequences, lengths):
  """A full cache after one causal pass over sequences [B, MAX_LEN], committed up to lengths.

  Slots past a row's length hold keys of later tokens: uncommitted junk the caches must ignore.
  """
  batch = sequences.shape[0]
  cache = KVCache.init(CONFIG, batch, MAX_LEN)
  positions = jnp.broadcast_to(jnp.arange(MAX_LEN, dtype=jnp.int32), (batch, MAX_LEN))
  _, _, cache = _forward(tiny_params(), CONFIG, jnp.asarray(sequences), positions, cache,
                         causal_attend(cache.lengths, MAX_LEN, MAX_LEN))
  return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


def last_tokens(sequences, lengths):
  return jnp.asarray(sequences[np.arange(len(lengths)), np.asarray(lengths) - 1])


@jax.jit
def _decode_step(params, context, tokens):
  """Feeds tokens [B] at the context's next positions with a 1-slot cache of their own, then
  appends them to the context: (logits [B, V], context)."""
  batch = tokens.shape[0]
  positions = getattr(context, "next_positions", context.lengths)[:, None]  # [B, 1]
  own = KVCache.init(CONFIG, batch, 1)
  logits, _, own = forward(params, CONFIG, tokens[:, None], positions, own,
                           jnp.ones((batch, 1, 1), bool), context=(context,))
  return logits[:, 0], context.append(own.advance(1))


def decode(context, sequences, steps):
  """Logits [steps, B, V] of the next `steps` tokens of each row, fed one by one through `context`."""
  out = []
  for _ in range(steps):
    positions = np.asarray(getattr(context, "next_positions", context.lengths))
    tokens = jnp.asarray(sequences[np.arange(len(positions)), positions])
    logits, context = _decode_step(tiny_params(), context, tokens)
    out.append(np.asarray(logits))
  return np.stack(out)


def by_slot(keys):
  """Keys or values as [..., S, D] (the caches store them [B, KVH, D, S], slots last)."""
  return np.swapaxes(np.asarray(keys), -1, -2)


# ------------------------------------------------------------------ retrieval: numpy reference

def reference_selection(query, keys, length, chunk, budget):
  """query [H, D], keys [KVH, S, D] of one row and layer -> (scores [KVH, C], chunks [KVH, N], kept)."""
  kvh, slots, _ = keys.shape
  group = query.shape[0] // kvh
  n_keep, n_chunks = budget // chunk, slots // chunk
  scores = np.zeros((kvh, n_chunks))
  for h in range(kvh):
    q = query[h * group:(h + 1) * group].sum(axis=0)
    for c in range(n_chunks):
      committed = keys[h, c * chunk:min((c + 1) * chunk, length)]
      scores[h, c] = q @ committed.mean(axis=0) if len(committed) else 0.0
  if length <= budget:
    return scores, np.tile(np.arange(n_keep), (kvh, 1)), length
  last = (length - 1) // chunk
  chunks = np.zeros((kvh, n_keep), int)
  for h in range(kvh):
    middle = np.argsort(-scores[h, 1:last], kind="stable")
    if n_keep > 2:
      gap = scores[h, 1:last][middle[n_keep - 3]] - scores[h, 1:last][middle[n_keep - 2]]
      assert gap > 1e-3, "test data has a near-tie at the top-k boundary; pick another seed"
    chunks[h] = [0, *sorted(middle[:n_keep - 2] + 1), last]
  kept = chunk + (n_keep - 2) * chunk + (length - last * chunk)
  return scores, chunks, kept


def assert_selection_matches(ret, full, queries, budget):
  """Chunks, kept lengths and gathered slots of `ret` agree with the numpy reference."""
  queries = np.asarray(queries)
  lengths = np.asarray(full.lengths)
  for layer in range(CONFIG.num_layers):
    k_full, v_full = by_slot(full.keys[layer]), by_slot(full.values[layer])
    k_ret, v_ret = by_slot(ret.keys[layer]), by_slot(ret.values[layer])
    for b, length in enumerate(lengths):
      _, chunks, kept = reference_selection(queries[layer, b], k_full[b], length, CHUNK, budget)
      np.testing.assert_array_equal(np.asarray(ret.chunks[layer, b]), chunks, err_msg=f"L{layer} b{b}")
      assert int(ret.lengths[b]) == kept and int(ret.dropped[b]) == length - kept
      for h in range(CONFIG.num_kv_heads):
        slots = (chunks[h][:, None] * CHUNK + np.arange(CHUNK)).ravel()[:kept]
        assert np.all(slots < length)
        np.testing.assert_array_equal(k_ret[b, h, :kept], k_full[b, h, slots])
        np.testing.assert_array_equal(v_ret[b, h, :kept], v_full[b, h, slots])


@pytest.mark.parametrize("budget", [32, 16, 64])  # sink + 2 chosen + last; sink + last; everything
def test_selection_matches_numpy_reference(budget):
  rng = np.random.default_rng(3)
  lengths = np.array([61, 40, 19, 33])  # partial last chunk, complete last chunk, fits, 1-slot last chunk
  batch, tail = len(lengths), 8
  counter = CompileCounter()
  for trial in range(2):  # the second call, with new values, must reuse the program
    shape = (batch, CONFIG.num_kv_heads, MAX_LEN, CONFIG.head_dim)
    full = KVCache(keys=tuple(jnp.swapaxes(jnp.asarray(rng.standard_normal(shape), jnp.float32), -1, -2)
                              for _ in range(2)),
                   values=tuple(jnp.swapaxes(jnp.asarray(rng.standard_normal(shape), jnp.float32), -1, -2)
                                for _ in range(2)),
                   lengths=jnp.asarray(lengths, jnp.int32))
    queries = jnp.asarray(2 * rng.standard_normal((2, batch, CONFIG.num_heads, CONFIG.head_dim)),
                          jnp.float32)
    counter.active = trial == 1
    ret = _select(full, queries, budget=budget, chunk=CHUNK, tail=tail)
    counter.active = False
    assert isinstance(ret, RetrievalCache)
    assert ret.max_len == budget + tail and ret.budget == budget and ret.tail == tail
    assert_selection_matches(ret, full, queries, budget)
    # the scores themselves (all chunks with a committed slot)
    for layer in range(2):
      got = np.asarray(retrieval.chunk_scores(queries[layer], full.keys[layer], full.lengths, CHUNK))
      for b, length in enumerate(lengths):
        want, _, _ = reference_selection(np.asarray(queries[layer, b]), by_slot(full.keys[layer][b]),
                                         length, CHUNK, budget)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)
    if budget == 32:  # heads and layers really choose differently (each gathers its own chunks)
      chunks = np.asarray(ret.chunks)
      assert (chunks[:, 0, 0] != chunks[:, 0, 1]).any() or (chunks[0, 0] != chunks[1, 0]).any()
  assert counter.count == 0, "a second selection with new values compiled something"


def test_selection_rejects_bad_budgets():
  full = KVCache.init(CONFIG, 1, MAX_LEN)
  queries = jnp.zeros((2, 1, CONFIG.num_heads, CONFIG.head_dim))
  for budget in (12, 8):
    with pytest.raises(ValueError, match="budget"):
      retrieval.select(full, queries, budget=budget, chunk=CHUNK)
  with pytest.raises(ValueError, match="multiple of chunk"):
    retrieval.select(KVCache.init(CONFIG, 1, 60), queries, budget=16, chunk=CHUNK)


# ------------------------------------------------------------------ retrieval: queries from the model

def rope_numpy(x, position):
  d = x.shape[-1]
  inv_freq = 1.0 / (CONFIG.rope_theta ** (np.arange(0, d, 2) / d))
  angles = np.concatenate([position * inv_freq] * 2)
  rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
  return x * np.cos(angles) + rotated * np.sin(angles)


def test_last_token_queries_recompute_the_prefill_exactly():
  params = tiny_params()
  sequences, lengths = random_sequences(1, 2), np.array([45, 21])
  full = prefill(sequences, lengths)
  got = _projections(params, CONFIG, full, last_tokens(sequences, lengths), ("q_proj", "k_proj"))
  assert got["q_proj"].shape == (2, 2, CONFIG.num_heads, CONFIG.head_dim)
  # The captured keys (same input as the queries) equal what prefill stored, at every layer:
  # the rerun saw exactly the prefill's context, and capture + reshape + RoPE are right.
  for layer in range(CONFIG.num_layers):
    for b, length in enumerate(lengths):
      np.testing.assert_allclose(np.asarray(got["k_proj"][layer, b]),
                                 by_slot(full.keys[layer])[b, :, length - 1], atol=ATOL)
  # Layer 0's query by hand: embedding -> RMSNorm -> q_proj -> RoPE.
  p = jax.tree.map(np.asarray, params)
  for b, length in enumerate(lengths):
    x = p["embed_tokens"]["embedding"][sequences[b, length - 1]]
    x = x / np.sqrt(np.mean(x * x) + CONFIG.rms_norm_eps) * p["layers_0"]["input_layernorm"]["weight"]
    q = (x @ p["layers_0"]["self_attn"]["q_proj"]["kernel"]).reshape(CONFIG.num_heads, CONFIG.head_dim)
    np.testing.assert_allclose(np.asarray(got["q_proj"][0, b]), rope_numpy(q, length - 1), atol=1e-4)


# ------------------------------------------------------------------ retrieval: attention

def test_budget_covering_the_context_is_exact():
  sequences, lengths = random_sequences(2, 2), np.array([45, 21])
  full = prefill(sequences, lengths)
  counter = CompileCounter()
  ret = _from_full(tiny_params(), CONFIG, full, last_tokens(sequences, lengths), budget=48,
                   chunk=CHUNK, tail=8)
  np.testing.assert_array_equal(np.asarray(ret.lengths), lengths)
  np.testing.assert_array_equal(np.asarray(ret.next_positions), lengths)
  # The next tokens through the retrieval cache (new keys go to its tail) equal the full cache's.
  np.testing.assert_allclose(decode(ret, sequences, 4), decode(full, sequences, 4), atol=ATOL)
  # New prompts of the same shapes compile nothing.
  sequences, lengths = random_sequences(3, 2), np.array([30, 48])
  full = prefill(sequences, lengths)
  with counter:
    ret = _from_full(tiny_params(), CONFIG, full, last_tokens(sequences, lengths), budget=48,
                     chunk=CHUNK, tail=8)
  assert counter.count == 0, "a second from_full compiled something"
  np.testing.assert_allclose(decode(ret, sequences, 2), decode(full, sequences, 2), atol=ATOL)


def test_the_queries_once_then_each_budget_choose_what_select_retrieval_chooses():
  """The planner's profile runs the model for the queries once and chooses per budget from them
  (long_caches.retrieval_queries, select_by_queries): the same caches as select_retrieval's."""
  from hitree_jax.decode import long_caches
  params = tiny_params()
  sequences, lengths = random_sequences(4, 2), np.array([45, 21])
  full, tokens = prefill(sequences, lengths), last_tokens(sequences, lengths)
  queries = long_caches.retrieval_queries(params, CONFIG, full, tokens)
  for budget in (16, 24, 32):
    once = long_caches.select_by_queries(full, queries, budget, CHUNK, 8, 1)
    whole = long_caches.select_retrieval(params, CONFIG, full, tokens, budget, CHUNK, 8, 1)
    np.testing.assert_array_equal(np.asarray(once.chunks), np.asarray(whole.chunks), err_msg=f"budget {budget}")
    for ours, theirs in zip(jax.tree.leaves(once), jax.tree.leaves(whole)):
      np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6)


def test_small_budget_keeps_the_selected_chunks():
  params = tiny_params()
  sequences, lengths = random_sequences(4, 2), np.array([45, 21])
  budget = 24  # row 0 (45 slots) keeps sink + 1 chosen chunk + its 5-slot last chunk; row 1 fits
  full = prefill(sequences, lengths)
  tokens = last_tokens(sequences, lengths)
  ret = _from_full(params, CONFIG, full, tokens, budget=budget, chunk=CHUNK, tail=8)
  np.testing.assert_array_equal(np.asarray(ret.lengths), [8 + 8 + 5, 21])
  np.testing.assert_array_equal(np.asarray(ret.next_positions), lengths)
  queries = _projections(params, CONFIG, full, tokens, ("q_proj",))["q_proj"]
  assert_selection_matches(ret, full, queries, budget)

  got, want = decode(ret, sequences, 3), decode(full, sequences, 3)
  assert np.isfinite(got).all()
  assert np.abs(got[:, 0] - want[:, 0]).max() > 1e-3  # row 0 lost context
  np.testing.assert_allclose(got[:, 1], want[:, 1], atol=ATOL)  # row 1 kept everything

  # reselect with a newer query: rebuilt from the full cache, tail emptied
  longer = full.replace(lengths=full.lengths + 3)
  again = _reselect(params, CONFIG, longer, last_tokens(sequences, lengths + 3),
                    budget=budget, chunk=CHUNK, tail=8)
  np.testing.assert_array_equal(np.asarray(again.next_positions), lengths + 3)
  np.testing.assert_array_equal(np.asarray(again.lengths), [24, 24])  # 48: 3 of 6 chunks; 24 fits


# ------------------------------------------------------------------ streaming

def reference_positions(seen, sinks, window):
  return set(range(min(sinks, seen))) | set(range(max(sinks, seen - window), seen))


def synthetic_cache(shape, position_of_slot, batch_tag):
  """Keys whose feature 0 is the token's position (feature 1 tags row, 2 head, 3 layer)."""
  kvh = shape[1]
  keys = []
  for layer in range(CONFIG.num_layers):
    k = np.zeros(shape, np.float32)
    k[..., 0] = position_of_slot[:, None, :]
    k[..., 1] = batch_tag[:, None, None]
    k[..., 2] = np.arange(kvh)[None, :, None]
    k[..., 3] = layer
    keys.append(jnp.asarray(k))
  stored = tuple(jnp.swapaxes(k, -1, -2) for k in keys)  # stored [.., D, S]
  return stored, tuple(-k for k in stored)


def assert_stream_holds(stream, reference_seen):
  sinks, window = stream.sinks, stream.window
  held = np.asarray(stream.positions())
  for b, seen in enumerate(reference_seen):
    want = reference_positions(seen, sinks, window)
    assert int(stream.seen[b]) == seen and int(stream.lengths[b]) == len(want)
    assert set(held[b, :len(want)]) == want and (held[b, len(want):] == -1).all()
    for layer in range(CONFIG.num_layers):
      k = by_slot(stream.keys[layer])[b, :, :len(want)]
      np.testing.assert_array_equal(k[..., 0], np.broadcast_to(held[b, :len(want)], k.shape[:2]))
      assert (k[..., 1] == b).all() and (k[..., 3] == layer).all()
      assert (k[..., 2] == np.arange(CONFIG.num_kv_heads)[:, None]).all()
      np.testing.assert_array_equal(by_slot(stream.values[layer])[b, :, :len(want)], -k)


def test_streaming_retains_sinks_and_last_window_across_wrapping_appends():
  sinks, window, kvh, d = 3, 8, CONFIG.num_kv_heads, CONFIG.head_dim
  prompt = np.array([13, 2, 30])
  batch = len(prompt)
  keys, values = synthetic_cache((batch, kvh, MAX_LEN, d), np.tile(np.arange(MAX_LEN), (batch, 1)),
                                 np.arange(batch))
  full = KVCache(keys=keys, values=values, lengths=jnp.asarray(prompt, jnp.int32))
  stream = _from_prefill(full, sinks, window)
  seen = prompt.copy()
  assert_stream_holds(stream, seen)

  append = jax.jit(StreamingCache.append)  # a program cache of its own, to count
  counter = CompileCounter()
  # Blocks of 6 slots with different commit counts per row; 20-slot blocks commit more than the window.
  blocks = [(6, [6, 0, 3]), (6, [2, 6, 6]), (6, [5, 1, 0]), (20, [20, 11, 9]), (6, [1, 6, 4]),
            (20, [0, 17, 20])]
  for t, count in blocks:
    count = np.asarray(count)
    positions = seen[:, None] + np.arange(t)[None, :]
    k, v = synthetic_cache((batch, kvh, t, d), positions, np.arange(batch))
    recent = KVCache(keys=k, values=v, lengths=jnp.asarray(count, jnp.int32))
    with counter:
      stream = append(stream, recent)
    seen = seen + count
    assert_stream_holds(stream, seen)
  assert append._cache_size() == 2 and counter.count <= 2, "one program per recent-cache shape"


def stream_mask(stream, t, max_len):
  """[B, T, S] over a full cache: the slots `stream` holds plus the block's own causal slots."""
  held = np.asarray(stream.positions())
  seen = np.asarray(stream.seen)
  attend = np.zeros((stream.batch, t, max_len), bool)
  for b in range(stream.batch):
    attend[b, :, held[b][held[b] >= 0]] = True
    for i in range(t):
      attend[b, i, seen[b]:seen[b] + i + 1] = True
  return jnp.asarray(attend)


def test_streaming_window_covering_the_context_is_exact():
  sequences, lengths = random_sequences(5, 2), np.array([30, 17])
  full = prefill(sequences, lengths)
  stream = _from_prefill(full, 4, 60)
  np.testing.assert_allclose(decode(stream, sequences, 4), decode(full, sequences, 4), atol=ATOL)
  with CompileCounter() as counter:  # new values, same shapes: nothing compiles
    _from_prefill(full.replace(lengths=jnp.asarray([5, 60], jnp.int32)), 4, 60)
  assert counter.count == 0


def test_streaming_small_window_equals_masked_full_attention():
  """Draft blocks of 3 tokens attend the stream (context) plus their own short cache; the
  reference runs them on a full cache under the mask of the positions the stream holds."""
  params = tiny_params()
  sequences, lengths = random_sequences(6, 2), np.array([30, 17])
  full = prefill(sequences, lengths)
  sinks, window, t = 4, 8, 3
  stream = _from_prefill(full, sinks, window)
  counts = [[3, 1], [2, 3], [1, 2], [3, 3], [0, 2]]
  counter = CompileCounter()
  for i, count in enumerate(counts):
    seen = np.asarray(stream.seen)
    positions = jnp.asarray(seen[:, None] + np.arange(t)[None, :], jnp.int32)
    tokens = jnp.asarray(np.take_along_axis(sequences, np.asarray(positions), axis=1))
    own = KVCache.init(CONFIG, 2, t)
    with counter:
      got, _, own = _forward(params, CONFIG, tokens, positions, own, causal_attend(own.lengths, t, t),
                             context=(stream,))
    want, _, full = _forward(params, CONFIG, tokens, positions, full, stream_mask(stream, t, MAX_LEN),
                             jnp.asarray(seen, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, err_msg=f"block {i}")
    if i == 0:  # the window matters: attending everything would give other logits
      everything, _, _ = _forward(params, CONFIG, tokens, positions, full,
                                  causal_attend(jnp.asarray(seen, jnp.int32), t, MAX_LEN),
                                  jnp.asarray(seen, jnp.int32))
      assert np.abs(np.asarray(everything) - np.asarray(got)).max() > 1e-3
    with counter:
      stream = _stream_append(stream, own.replace(lengths=jnp.asarray(count, jnp.int32)))
    # what the stream holds are the reference's keys at those positions
    held = np.asarray(stream.positions())
    for layer in range(CONFIG.num_layers):
      for b in range(2):
        n = int(stream.lengths[b])
        np.testing.assert_allclose(by_slot(stream.keys[layer])[b, :, :n],
                                   by_slot(full.keys[layer])[b][:, held[b, :n]], atol=ATOL)
    if i == 0:
      counter.count = 0  # the first block compiles; later ones must not
  assert counter.count == 0, "a later block compiled something"


def test_streaming_reindex_moves_only_the_sinks_right_before_the_ring():
  """StreamingLLM's positions within the cache: each sink key is rotated forward by how far the
  ring has moved (seen - sinks - window), incrementally across appends; nothing else changes."""
  from hitree_jax.model.llama import rope_inv_freq
  sequences, lengths = random_sequences(8, 2), np.array([40, 9])  # row 1 still fits: no shift
  full = prefill(sequences, lengths)
  sinks, window = 3, 8
  freq = jnp.asarray(rope_inv_freq(CONFIG))
  reindexed = jax.jit(StreamingCache.from_prefill, static_argnums=(1, 2))(full, sinks, window, freq)
  plain = _from_prefill(full, sinks, window)

  def check(reindexed, plain):
    seen = np.asarray(plain.seen)
    shift = np.maximum(seen - sinks - window, 0)
    np.testing.assert_array_equal(np.asarray(reindexed.sink_shift), shift)
    for layer in range(CONFIG.num_layers):
      got, base = by_slot(reindexed.keys[layer]), by_slot(plain.keys[layer])
      np.testing.assert_array_equal(got[:, :, sinks:], base[:, :, sinks:])
      np.testing.assert_array_equal(np.asarray(reindexed.values[layer]), np.asarray(plain.values[layer]))
      for b in range(len(seen)):
        np.testing.assert_allclose(got[b, :, :sinks], rope_numpy(base[b, :, :sinks], shift[b]), atol=1e-4)
    assert shift[0] > 0 and shift[1] == 0

  check(reindexed, plain)
  # A block of 5 committed tokens (row 1: 2): the ring moves on, and so do the sinks.
  block = KVCache.init(CONFIG, 2, 5)
  positions = jnp.asarray(lengths[:, None] + np.arange(5)[None, :], jnp.int32)
  _, _, block = _forward(tiny_params(), CONFIG, jnp.asarray(sequences[:, :5]), positions, block,
                         causal_attend(block.lengths, 5, 5), None, (full,))
  block = block.replace(lengths=jnp.asarray([5, 2], jnp.int32))
  check(_stream_append(reindexed, block), _stream_append(plain, block))
