"""Measured cost curves and acceptance of the planner's candidate levels.

A level's cost at context length c and width w is the median time of one
forward of w tokens through its model, over its long cache of a c-token book
prompt (read-only context, as in decoding) and a recent cache: exactly the
forward a level runs in a round (logits included). Levels are named as in
the --levels grammar:

  target                    the target over its full cache
  retrieval:B               the target over a B-slot retrieval cache (TriForce's)
  self:K                    the target's first K layers over their full cache
  draft                     a draft model over its full cache
  draft@streaming:SxW       a draft model over a StreamingLLM cache of S sinks and W recent tokens
  eagle                     an EAGLE feature draft (heads/eagle.py) over its one-layer cache; it
                            proposes to a level with the target's weights (the target, or the
                            target over a retrieval cache), whose features it reads

Acceptance is measured between pairs of levels on a continuation of the
prompt (`pair_acceptance`; `ngram[:N]` proposes too). What a round costs
beside its forwards is fitted to whole generations (`round_overheads`), and
`ar_seconds` is the baseline every stack must beat. Profiles are JSON, reused
while the key (model, draft, machine, jax version) is the same (`cached`;
planner/auto.py assembles and keeps them).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import pathlib
import platform
import statistics
import time
import types
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from hitree_jax import stacks
from hitree_jax.cache.full import KVCache, dtypes_of
from hitree_jax.decode import engine, long_caches, spec
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.programs import Programs, ahead_of_time, compile_together
from hitree_jax.decode.sampling import probabilities
from hitree_jax.cache.kinds import Retrieval, Streaming
from hitree_jax.errors import UsageError
from hitree_jax.heads import eagle as eagle_lib
from hitree_jax.model.llama import forward
from hitree_jax.model.vocab import spread_probs
from hitree_jax.planner import optimize
from hitree_jax.planner.optimize import TARGET
from hitree_jax.roofline import RECENT_SLOTS, forward_inputs
from hitree_jax.train.metrics import PROFILE_RANKS

# A profile's levels are the --levels grammar's (spec.Level) and the target above them all; its
# JSON names each by its text, str(level).
Level = optimize.Name   # spec.Level, or TARGET
EAGLE = spec.Level.of(spec.FeatureDraft("eagle"))   # load_eagle's draft, whatever its path


def level_named(name: str) -> Level:
  """A level from its name in a profile's JSON."""
  return TARGET if name == TARGET else spec.parse_level(name)


def _is_ngram(level: Level) -> bool:
  return level != TARGET and level.kind == "ngram"


FORWARDS_PER_CALL = 8  # a timed call runs this many forwards in one program
# A level's timings stop after this many seconds once each width has MIN_REPEATS (each repeat is
# FORWARDS_PER_CALL forwards of every width): SmolLM2's target at 512 tokens takes about 4 s for
# ten repeats of its three widths, 8 s at 2K; a longer context or a larger batch gets fewer (three
# at least), a draft all ten. Ten repeats of five widths had taken minutes per level at batch 16.
LEVEL_SECONDS = 3.0
MIN_REPEATS = 3


def timed_forward(config):
  """A program of FORWARDS_PER_CALL forwards, one after the other (each one's tokens depend on
  the last one's logits, so none can be hoisted or merged): its time / FORWARDS_PER_CALL is a
  forward's inside a decoding program, without the host's dispatch and wait, which are a
  fifth of a 2 ms draft forward's time when it is called alone."""
  @jax.jit
  def run(params, tokens, long):
    positions, recent, attend = forward_inputs(config, tokens, long)

    def one(_, carry):
      fed = tokens + (carry > jnp.inf).astype(tokens.dtype)    # always tokens, but after `carry`
      logits, _, _ = forward(params, config, fed, positions, recent, attend, context=(long,))
      return logits[0, -1, 0]

    return jax.lax.fori_loop(0, FORWARDS_PER_CALL, one, jnp.float32(0))
  return ahead_of_time(run)


def _timed_eagle_forward(config, reduced: bool):
  """timed_forward for an EAGLE draft: w tokens (with their features) through its layer over its
  long cache and a recent one, then its head: what a round runs per depth of its tree."""
  @jax.jit
  def run(params, embedding, tokens, long):
    positions, recent, attend = forward_inputs(config, tokens, long)
    prev = jnp.zeros((*tokens.shape, config.hidden_size), long.values[0].dtype)

    def one(_, carry):
      fed = tokens + (carry > jnp.inf).astype(tokens.dtype)    # always tokens, but after `carry`
      out, _ = eagle_lib.features(params, config, embedding, fed, prev, positions, recent, attend,
                                  context=(long,))
      return eagle_lib.logits(params, out, reduced)[0, -1, 0]

    return jax.lax.fori_loop(0, FORWARDS_PER_CALL, one, jnp.float32(0))
  return ahead_of_time(run)


def load_eagle(path, target) -> types.SimpleNamespace:
  """An EAGLE draft (a launch.distill --kind=eagle folder) for `target`: config, params (the
  target's head on its vocabulary included), vocab (ReducedVocab or None)."""
  from hitree_jax.heads import saved
  meta, params, vocab = saved.load(path, target.params, target.config, "eagle")
  drafter = saved.drafter(meta, target.config)
  return types.SimpleNamespace(config=drafter.config, params=params, vocab=vocab, taps=drafter.taps)


def _first_layers(params, cache: KVCache, k: int):
  kept = {name: value for name, value in params.items()
          if not name.startswith("layers_") or int(name.split("_")[1]) < k}
  return kept, cache.replace(keys=cache.keys[:k], values=cache.values[:k])


class _Levels:
  """Each named level's (config, params, long cache, draft vocabulary or None) after a prompt,
  in `rows` copies (a batch: what a round at that batch size reads); `timed` times a level's
  forward, `eagle_long` is an EAGLE draft's cache of the prompt."""

  def __init__(self, target, draft, prompt: Sequence[int], extra: int, eagle=None, rows: int = 1,
               full: KVCache | None = None):
    """full: the target's cache of the prompt, prefilled already (a generation's, `rows` rows;
    its slots past the prompt are not read), for a level set without an EAGLE draft, which
    reads the prefill's features: at 7.5K tokens a prefill is 15 s on 2 cores."""
    self.target, self.draft, self.eagle, self.prompt, self.rows = target, draft, eagle, list(prompt), rows
    self.programs = Programs()
    c = target.config
    self.batch = prefill_lib.make_batch([self.prompt] * rows, c, 1)
    self.taps = () if eagle is None else eagle.taps
    self.prompt_hidden = None   # [rows, P', E]: what an EAGLE draft's prefill reads
    if full is not None and eagle is None:
      self.slots, self.full = full.max_len, full.replace(lengths=jnp.full((rows,), len(prompt), jnp.int32))
    else:
      self.slots = prefill_lib.cache_slots(len(prompt), extra, extra=RECENT_SLOTS)
      _, self.full, *hidden = prefill_lib.prefill(target.params, c, KVCache.init(c, rows, self.slots), self.batch,
                                                  self.programs, all_hidden=eagle is not None, taps=self.taps)
      self.prompt_hidden = hidden[0] if hidden else None
    self._draft_full = self._eagle_long = self._queries = None
    self._selected = {}   # retrieval level -> its cache, chosen once

  def eagle_long(self) -> KVCache:
    """The EAGLE draft's one-layer cache of the prompt, run with the target's features (as prefill
    builds it in decoding)."""
    if self.eagle is None:
      raise UsageError("level 'eagle' needs an EAGLE draft (eagle:PATH)")
    if self._eagle_long is None:
      e = self.eagle
      tokens, chunk = prefill_lib.chunked_tokens(self.batch)
      self._eagle_long = eagle_lib.prefill(e.params, e.config, self.target.params["embed_tokens"]["embedding"],
                                           KVCache.init(e.config, self.rows, self.slots), tokens, self.prompt_hidden,
                                           self.batch.lengths, chunk, self.programs)
    return self._eagle_long

  def last_prompt_feature(self) -> jax.Array:
    """[1, E] the target's feature of the last prompt token (what an EAGLE draft reads first;
    with its taps, [1, (k+1)E])."""
    return self.prompt_hidden[:, len(self.prompt) - 1]

  def timed(self, level: Level) -> tuple[Callable, Callable[[int], tuple]]:
    """(a program of FORWARDS_PER_CALL forwards of the level, width -> its arguments)."""
    if level == EAGLE:
      e, long = self.eagle, self.eagle_long()
      embedding = self.target.params["embed_tokens"]["embedding"]
      return (_timed_eagle_forward(e.config, e.vocab is not None),
              lambda w: (e.params, embedding, jnp.zeros((self.rows, w), jnp.int32), long))
    config, params, long, _ = self[level]
    return timed_forward(config), lambda w: (params, jnp.zeros((self.rows, w), jnp.int32), long)

  def retrieval_queries(self) -> jax.Array:
    """[L, B, H, D] the last prompt token's queries, which choose every budget's chunks."""
    if self._queries is None:
      t = self.target
      last = jnp.full((self.rows,), self.prompt[-1], jnp.int32)
      self._queries = long_caches.retrieval_queries(t.params, t.config, self.full, last)
    return self._queries

  def build_shared(self, levels: Sequence[Level]) -> None:
    """Builds what several of these levels read (the draft's cache of the prompt, the retrieval
    queries) before threads share them, so that none is built twice."""
    if any(level != TARGET and level.source == spec.DraftModel() for level in levels):
      self.draft_full(None)
    if any(map(_chosen_once, levels)):
      self.retrieval_queries()

  def draft_full(self, level: Level):
    if self.draft is None:
      raise UsageError(f"level {str(level)!r} needs a draft model")
    if self._draft_full is None:
      d = self.draft
      ids = self.prompt if d.vocab is None else d.vocab.to_draft(self.prompt).tolist()
      _, self._draft_full = prefill_lib.prefill(d.params, d.config, KVCache.init(d.config, self.rows, self.slots),
                                                prefill_lib.make_batch([ids] * self.rows, d.config, 1),
                                                self.programs)
    return self._draft_full

  def __getitem__(self, level: Level):
    t = self.target
    if level == TARGET:
      return t.config, t.params, self.full, None
    if _chosen_once(level):
      if level not in self._selected:
        self._selected[level] = long_caches.select_by_queries(self.full, self.retrieval_queries(), level.budget,
                                                              level.retrieval.chunk, self.slots - len(self.prompt), 1)
      return t.config, t.params, self._selected[level], None
    if isinstance(level.source, spec.SelfDraft):
      k = level.source.layers
      return (t.config.replace(num_layers=k), *_first_layers(t.params, self.full, k), None)
    streaming = isinstance(level.cache, Streaming) and not level.cache.reindex
    if level.source == spec.DraftModel() and level.mode == "deterministic" and (level.cache is None or streaming):
      full = self.draft_full(level)
      cache = level.cache
      long = full if cache is None else long_caches.streaming_cache(full, cache.sinks, cache.window, None)
      return self.draft.config, self.draft.params, long, self.draft.vocab
    raise UsageError(f"unknown level {str(level)!r}: expected target, retrieval:B, self:K, draft, "
                     "draft@streaming:SxW or eagle")


def _chosen_once(level: Level) -> bool:
  """Whether the level reads a retrieval cache chosen once after the prompt (not reselected)."""
  return level != TARGET and level.kind == "retrieval" and not level.retrieval.reselect


def _retrieval_budgets(levels: Sequence[Level]) -> list[Level]:
  """The levels over a retrieval cache chosen once after the prompt, smallest budget first."""
  return sorted(filter(_chosen_once, levels), key=lambda level: level.budget)


def interpolated_budgets(levels: Sequence[Level]) -> list[Level]:
  """The retrieval levels whose forwards level_costs(interpolate_budgets=True) reads off the line
  through the smallest budget's and the target's instead of timing them: each runs the target's
  weights over its budget and the recent slots, as the target runs over the prompt and the same
  recent slots, and a forward's cost is affine in the slots it reads. At 7,680 tokens the line
  gave retrieval:512's and retrieval:1024's timings within 5% (1-2% at widths 4 and 16) and
  saves their selections, programs and timings: 23 s of a first profile there
  (docs/results/planner/first_profile_time.md)."""
  budgets = _retrieval_budgets(levels)
  return budgets[1:] if TARGET in levels else []


def level_costs(target, draft, levels: Sequence[Level], prompt: Sequence[int], widths: Sequence[int],
                repeats: int = 10, eagle=None, rows: int = 1, full: KVCache | None = None,
                interpolate_budgets: bool = False) -> dict:
  """{level name: {width: seconds}} at the context of `prompt` (token ids of the target), the
  median of `repeats` timings (fewer, at least MIN_REPEATS, past LEVEL_SECONDS), the widths of a
  level interleaved: a machine's drift (another process, the clock) then spreads over them all
  instead of bending the curve.
  target, draft: loading.LoadedModel (draft may be None when no name needs one); eagle:
  load_eagle's, for the level 'eagle'; rows: the batch a forward runs (its w tokens in each of
  `rows` rows, over `rows` caches: measured, since a batch's forward is not `rows` times one
  row's, nor one row's); full: the target's cache of the prompt from a generation (_Levels'),
  read where it has the slots the timed forwards would have (they read all of them). Every
  program is compiled before any is timed (compile_together). interpolate_budgets: the
  retrieval levels of `interpolated_budgets(levels)` read off the line, not timed."""
  same_slots = full is not None and full.max_len == prefill_lib.cache_slots(len(prompt), 0, extra=RECENT_SLOTS)
  cached = _Levels(target, draft, prompt, 0, eagle, rows, full=full if same_slots else None)
  on_the_line = interpolated_budgets(levels) if interpolate_budgets else []
  programs = {}
  for level in (level for level in levels if level not in on_the_line):
    run, args_of = cached.timed(level)
    programs[str(level)] = run, {w: args_of(w) for w in widths}
  compile_together([run.compiling(*args) for run, calls in programs.values() for args in calls.values()])
  out = {}
  for name, (run, calls) in programs.items():
    for args in calls.values():
      jax.block_until_ready(run(*args))                      # warms up
    times, started = {w: [] for w in widths}, time.perf_counter()
    for done in range(repeats):
      if done >= MIN_REPEATS and time.perf_counter() - started > LEVEL_SECONDS:
        break
      for w, args in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times[w].append(time.perf_counter() - start)
    out[name] = {w: statistics.median(t) / FORWARDS_PER_CALL for w, t in times.items()}
  if on_the_line:
    smallest = _retrieval_budgets(levels)[0]
    low, high = out[str(smallest)], out[str(TARGET)]
    for level in on_the_line:
      share = (level.budget - smallest.budget) / (len(prompt) - smallest.budget)
      out[str(level)] = {w: low[w] + share * (high[w] - low[w]) for w in widths}
  return {str(level): out[str(level)] for level in levels}


def round_overheads(target, draft, prompt: Sequence[int], sampling, budget: int = 512,
                    max_new_tokens: int = 96, costs: dict | None = None, rows: int = 1) -> dict:
  """latency.Overheads' fields, fitted to whole generations of six reference stacks:

    draft/chain:1, draft/chain:4, draft/kary:2x2, draft@streaming:16x234/chain:1+retrieval:BUDGET/6,
    ngram:3/chain:2+draft/3, ngram:3/chain:4

  In each, the decode seconds less its forwards' (level_costs at the widths the engine runs,
  latency.static_widths and the drafter's lead; an n-gram's verifier at its mean offer) are the model drafter's forwards x draft_forward +
  verifying rounds x verify + rounds verifying a tree x tree + a middle level's rounds x middle:
  six equations, four unknowns, least squares. The two hierarchies pin `middle`: at 16 rows
  their rounds left 23-29 ms each beside their forwards, a single level's 5-19 ms, and fitted
  as one `verify` they made it 23 ms (docs/results/planner/batch_overheads_512.md).
  ngram:3/chain:4 runs no draft forward, so it pins `verify` apart from `draft_forward`, which
  every other stack pays with it (at 512 tokens, fitted without it:
  draft_forward 0 and verify 7.1 ms). ngram:3/chain:2+draft/3 runs several cheap
  rounds of its middle level per target forward, as deep stacks do, so its rows pin `verify`
  down where the others (few rounds, each mostly forward) leave it to the forwards' noise: fitted
  without it, verify came out 1.2-3.1 ms across context lengths (a four-level stack pays it about
  11 times per target forward); with it, 2.1 and 2.5 ms at 2K and 4K. Whole generations, not
  rounds timed alone (engine.generate's time_levels), so the loop's own cost is in, and the
  noise of a few milliseconds per timing averages out over ~100 tokens. (A per-token term came
  out negative here: not resolved by these widths, and left out.) costs: level_costs already
  measured at this prompt and batch (the forwards it needs are timed only where missing); rows:
  the batch, `rows` copies of the prompt, every round's forwards and overheads paid once for all."""
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.planner.latency import affine, draft_pending, drafter_lead, static_widths, tree_draft_seconds

  t, d = target, draft
  weights = DraftWeights.create(d.params, d.vocab)
  model, ngram = spec.Level.of(spec.DraftModel()), spec.Level.of(spec.NGram(3))
  streaming, retrieval = spec.Level.of(spec.DraftModel(), Streaming(16, 234)), spec.Level.of(Retrieval(budget))
  references = [spec.Levels(model, spec.Chain(1)), spec.Levels(model, spec.Chain(4)),
                spec.Levels(model, spec.Kary(2, 2)), spec.Levels(streaming, spec.Chain(1), ((retrieval, 6),)),
                spec.Levels(ngram, spec.Chain(2), ((model, 3),)), spec.Levels(ngram, spec.Chain(4))]
  measured = [([*levels.levels, TARGET], [gamma for _, gamma in levels.middles],
               stacks.build(levels, t.config, d.config, d.vocab)) for levels in references]
  costs = dict(costs or {})
  missing = [level for level in (TARGET, retrieval, model, streaming) if str(level) not in costs]
  if missing:
    costs.update(level_costs(t, d, missing, prompt, [1, 2, 4, 8], rows=rows))
  curve = {name: affine(points) for name, points in costs.items()}   # by the levels' names
  programs, equations, rest = Programs(), [], []
  for levels, gammas, stack in measured:
    names = list(map(str, levels))
    runs = [engine.generate(t.params, t.config, [list(prompt)] * rows, max_new_tokens=max_new_tokens, stack=stack,
                            sampling=sampling, stop_at_eos=False, draft=weights, programs=programs)
            for _ in range(2)]
    run = min(runs, key=lambda r: r.decode_s)
    proposals, drafter = run.levels[0]["forwards"], curve.get(names[0])
    widths = static_widths(stack.tree, gammas)   # the forwards' widths as the engine runs them
    seconds = run.decode_s - proposals * (tree_draft_seconds(stack.tree, drafter) + draft_pending(
        drafter, drafter_lead(len(gammas) + 1, stack.tree)))
    is_tree = stack.tree.max_branching > 1
    middle_rounds = sum(level["forwards"] for level in run.levels[:-1])   # the levels under the target
    equation = [proposals * stack.tree.max_depth * (names[0] in curve), 0.0, proposals * is_tree, middle_rounds]
    offers = _is_ngram(levels[0])   # its verifier runs the narrowest width holding the offer
    for level in run.levels:  # at their static widths; prompt lookup's verifier at its mean offer (a row's)
      j = level["level"]
      offered = j == 1 and offers
      width = level["proposed"] / level["forwards"] / rows + len(gammas) + 1 if offered else widths[j - 1]
      seconds -= level["forwards"] * curve[names[j]](width)
      equation[1] += level["forwards"]
    equations.append(equation)
    rest.append(seconds)
  fit = nonnegative_least_squares(np.array(equations), np.array(rest))
  return {"draft_forward": float(fit[0]), "verify": float(fit[1]), "tree": float(fit[2]), "middle": float(fit[3])}


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """argmin |a x - b| over x >= 0, for a few columns: the best of the unconstrained fits on every
  subset of columns (the others 0) whose solution is non-negative. An overhead is not negative;
  an unconstrained fit of noisy timings can make one so and inflate another."""
  n = a.shape[1]
  best, best_residual = np.zeros(n), float(np.sum(b ** 2))
  for mask in range(1, 2 ** n):
    columns = [i for i in range(n) if mask >> i & 1]
    x = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
    if (x >= 0).all():
      full = np.zeros(n)
      full[columns] = x
      residual = float(np.sum((a @ full - b) ** 2))
      if residual < best_residual:
        best, best_residual = full, residual
  return best


def ar_seconds(target, prompt: Sequence[int], max_new_tokens: int = 96, rows: int = 1, sampling=None) -> float:
  """Seconds per token of a row of plain decoding (`ar`) after `prompt`, in a batch of `rows`
  copies (a step's seconds: every row gains a token), at `sampling` (default greedy; sampling
  costs a step more than an argmax): what every stack at that sampling must beat."""
  programs = Programs()
  runs = [engine.generate(target.params, target.config, [list(prompt)] * rows, max_new_tokens=max_new_tokens,
                          sampling=sampling, stop_at_eos=False, programs=programs) for _ in range(2)]
  return rows / max(r.decode_tokens_per_s for r in runs)


# A continuation is teacher-forced padded to a multiple of this: chat answers end where the target
# ends its turn, and twelve lengths compiled each level's program twelve times (80 programs, 34 s of
# a 2-minute chat profile). A position sees only those before it, so the padding changes none.
CONTINUATION_BUCKET = 64


def _padded(n: int) -> int:
  return -(-n // CONTINUATION_BUCKET) * CONTINUATION_BUCKET


def _continuation_probs(config, params, long, vocab, tokens, target_vocab: int, sampling, taps=()):
  """The level's sampling distribution [N, V_target], its top-R tokens [N, R] (target ids) and
  its features [1, N, E] (with taps, [1, N, (k+1)E]) at each of the N continuation tokens,
  teacher-forced in one chunk over its long cache."""
  n = len(tokens)
  tokens = list(tokens) + [tokens[-1]] * (_padded(n) - n)
  ids = jnp.asarray(tokens if vocab is None else vocab.to_draft(np.asarray(tokens)), jnp.int32)[None]
  probs, ranked, hidden = _teacher_forced(config, params, long, vocab, ids, target_vocab, sampling, taps)
  return probs[:n], ranked[:n], hidden[:, :n]


# One program per level's shapes: run op by op, a profile compiled some 390 small programs (40 s
# of a 4-minute profile at 512 tokens).
@functools.partial(jax.jit, static_argnames=("config", "vocab", "target_vocab", "taps"))
def _teacher_forced(config, params, long, vocab, ids, target_vocab: int, sampling, taps):
  n = ids.shape[1]
  recent = KVCache.init(config, 1, n, **dtypes_of(long))
  positions = long.next_positions[:, None] + jnp.arange(n)[None, :]
  logits, hidden, _ = forward(params, config, ids, positions, recent, jnp.tril(jnp.ones((n, n), bool))[None],
                              context=(long,), taps=taps)
  return (*_ranked_probs(logits[0], vocab, target_vocab, sampling), hidden)


def _ranked_probs(logits, vocab, target_vocab: int, sampling):
  """logits [N, V'] -> (sampling distribution [N, V_target], top-R tokens [N, R] in target ids)."""
  ranked = jax.lax.top_k(logits, PROFILE_RANKS)[1]
  probs = probabilities(logits, sampling)
  if vocab is None:
    return probs, ranked
  target_ids = jnp.asarray(vocab.target_ids)
  return spread_probs(probs, target_ids, target_vocab), target_ids[ranked]


def _eagle_continuation_probs(levels: _Levels, features, tokens, target_vocab: int, sampling):
  """For the EAGLE draft proposing to the level whose features [1, N, E] (with its taps,
  [1, N, (k+1)E]) over the continuation it reads: (its distribution [N, V_target] and top-R
  tokens [N, R] at each continuation token, as at a tree's first depth: reading that token and
  the feature of the one before (of the last prompt token, the target's, first); its
  distribution [N, V_target] as at a deeper node: reading the feature the first pass predicted
  at the token before instead (index 0: none, unused)). As training's two passes
  (train/heads.py), over the draft's cache of the prompt."""
  from hitree_jax.train.heads import two_passes
  e, long = levels.eagle, levels.eagle_long()
  ids = jnp.asarray(tokens, jnp.int32)[None]
  positions = long.next_positions[:, None] + jnp.arange(ids.shape[1])[None, :]
  first, again = two_passes(e.params, e.config, levels.target.params["embed_tokens"]["embedding"], ids,
                            features, before=levels.last_prompt_feature(), positions=positions,
                            context=(long,))
  reduced = e.vocab is not None
  q, ranked = _ranked_probs(eagle_lib.logits(e.params, first[0], reduced), e.vocab, target_vocab, sampling)
  q_deep, _ = _ranked_probs(eagle_lib.logits(e.params, again[0], reduced), e.vocab, target_vocab, sampling)
  return q, ranked, q_deep


def _ngram_matches(history: Sequence[int], start: int, max_ngram: int, min_ngram: int):
  """Yields (end, the end index of the latest earlier match of history[:end]'s longest
  (min_ngram..max_ngram) suffix or -1, that suffix's length) for end = start .. len(history):
  drafters.NGramDrafter's search."""
  seq = np.asarray(history)
  for end in range(start, len(seq) + 1):
    best, length = -1, 0
    match = np.arange(end) < end - 1          # a match ends strictly before the suffix does
    for n in range(1, max_ngram + 1):
      j = n - 1
      if end - 1 - j < 0:
        break
      shifted = np.concatenate([np.full(j, -1), seq[:end - j]]) if j else seq[:end]
      match &= (np.arange(end) >= j) & (shifted == seq[end - 1 - j])
      if match.any() and n >= min_ngram:
        best, length = int(np.nonzero(match)[0].max()), n
    yield end, best, length


def ngram_proposals(history: Sequence[int], start: int, max_ngram: int, min_ngram: int = 1) -> np.ndarray:
  """[len(history) - start + 1]: the token the n-gram drafter (drafters.NGramDrafter) proposes
  after each prefix history[:end], end = start .. len(history): what followed the latest earlier
  match of the longest (min_ngram..max_ngram) suffix, else -1 (it offers nothing)."""
  seq = np.asarray(history)
  return np.asarray([seq[best + 1] if best >= 0 else -1
                     for _, best, _ in _ngram_matches(seq, start, max_ngram, min_ngram)], np.int32)


def ngram_offers(history: Sequence[int], start: int, max_ngram: int, min_ngram: int = 1) -> np.ndarray:
  """[len(history) - start + 1]: how many tokens the n-gram drafter offers after each prefix (as
  ngram_proposals), on a chain long enough for all: what followed the match, at most 2**n for a
  match of n tokens; 0 where none matched."""
  return np.asarray([_offered(end, best, n) for end, best, n in _ngram_matches(history, start, max_ngram, min_ngram)],
                    np.int32)


def _offered(end: int, best: int, n: int) -> int:
  """How many tokens the n-gram drafter offers after history[:end] (_ngram_matches' match ending at
  `best`, of n tokens): what followed the match, at most 2**n (drafters.NGramDrafter)."""
  return min(end - 1 - best, 2 ** n) if best >= 0 else 0


def _ngram_probs(lookup: spec.NGram, prompt, continuation, vocab_size: int):
  """An n-gram level as a proposer: a one-hot q on its proposal, which is its only rank (none
  where it offers nothing). Row k is its proposal after continuation[k], as a model level's row
  k is (_continuation_probs)."""
  tokens = ngram_proposals(list(prompt) + list(continuation), len(prompt) + 1, lookup.longest, lookup.shortest)
  ranked = np.full((len(tokens), PROFILE_RANKS), -1, np.int32)
  ranked[:, 0] = tokens
  return jax.nn.one_hot(tokens, vocab_size), jnp.asarray(ranked)


def _offered_counts(lookup: spec.NGram, prompt, continuation) -> list[float]:
  """An n-gram level's law of how many tokens it offers at a position (ngram_offers; index m:
  the share offering m, the last index m or more), for latency.first_round."""
  counts = ngram_offers(list(prompt) + list(continuation), len(prompt) + 1, lookup.longest, lookup.shortest)
  return (np.bincount(np.minimum(counts, MAX_OFFERED), minlength=MAX_OFFERED + 1) / len(counts)).tolist()


MAX_OFFERED = 32   # offered counts beyond it are recorded as it (no chain the planner tries is longer)


def ngram_rounds(lookup: spec.NGram, prompt, continuation, probs: jax.Array, chains: Sequence[int]) -> dict:
  """{chain size n: rounds [n + 1][n + 1]}: prompt lookup's rounds replayed over the continuation
  as the engine runs them, rounds[m][k] the expected number that offered m tokens and had k
  accepted. Its hits come in runs (a repeat is matched token after token), so the law of a
  round's accepted length is not that of independent positions: at 512 tokens of Austen those
  predicted 1.69 tokens a forward for its chain of 3 where the engine committed 1.84
  (docs/results/planner/continuation_length.md). A round starting after s tokens of the
  continuation offers what followed the match there (ngram_offers), the verifier accepts its
  i-th token with probs[s - 1 + i] of it (probs [N, V]: the verifier's sampling distribution,
  teacher-forced: one-hot when greedy, where the replay is exact), and the next round starts
  after the accepted ones and one more. Under sampling a round is taken to follow the
  continuation, which one sample of the target's text stands for. Only rounds whose whole chain
  lies within the continuation are counted (no edge effect at its end)."""
  history, n_max, count = list(prompt) + list(continuation), max(chains), len(continuation)
  tokens = np.full((count + 1, n_max), -1, np.int32)        # [state s, i]: the i-th offered token
  offered = np.zeros(count + 1, np.int32)
  for end, best, n in _ngram_matches(history, len(prompt) + 1, lookup.longest, lookup.shortest):
    s = end - len(prompt)
    offered[s] = _offered(end, best, n)
    take = min(offered[s], n_max)
    tokens[s, :take] = history[best + 1:best + 1 + take]
  rows = np.arange(count + 1)[:, None] - 1 + np.arange(n_max)[None, :]     # the row predicting it
  valid = (tokens >= 0) & (rows < count) & (rows >= 0)
  accept = np.where(valid, np.asarray(jnp.asarray(probs)[np.clip(rows, 0, count - 1), np.maximum(tokens, 0)]), 0.0)
  out = {}
  for n in chains:
    rounds, visit = np.zeros((n + 1, n + 1)), np.zeros(count + n + 2)
    visit[1] = 1.0
    for s in range(1, count - n + 2):                       # the chain's last row is s + n - 2
      if not visit[s]:
        continue
      m = min(int(offered[s]), n)
      reach = np.cumprod(np.concatenate([[1.0], accept[s, :m]]))   # P(accepted >= k), k = 0 .. m
      law = reach - np.append(reach[1:], 0.0)
      rounds[m, :m + 1] += visit[s] * law
      visit[s + 1:s + m + 2] += visit[s] * law
    out[str(n)] = rounds.tolist()
  return out


def pair_acceptance(target, draft, pairs: Sequence[tuple[Level, Level]], prompt: Sequence[int],
                    continuation: Sequence[int], sampling, eagle=None, chains: Sequence[int] = (),
                    target_cache: KVCache | None = None) -> dict:
  """{"verifier<-proposer": acceptance} over a continuation of `prompt` (the target's own, as a
  stack meets it), each level over its own caches of the prompt. Per pair: `alpha`, the expected
  acceptance of one proposed token, E sum_x min(p, q) (Leviathan et al.); `greedy`, how often the
  proposer's top token is the verifier's; `profile`, Sequoia's per-rank acceptance of the
  proposer's top-R tokens, p(x_r) (train/metrics.py); `greedy_profile`, the same for a greedy
  verifier; `alpha_next` and `greedy_next`, the same rates at a position after an accepted one
  (equal to alpha and greedy if positions are independent). A proposer `ngram[:N]` is the n-gram
  drafter over the prompt and the continuation so far (one rank: its proposal), and its record
  has `offered`, the share of positions where it proposes at all (the rates count the others as
  misses), and with `chains`, its rounds replayed for chains of those sizes (`ngram_rounds`);
  target_cache: the target's cache of the prompt from the generation of the continuation (one
  row: engine.generate's keep_long_caches), not prefilled again; `eagle`
  (load_eagle's) reads its verifier's features, so its rates are per verifier. The continuation
  runs as one chunk, so a StreamingLLM window holds it all (the window slides token by token in
  decoding): an approximation for continuations much shorter than the window."""
  return pair_acceptances(target, draft, pairs, prompt, [continuation], sampling, eagle, chains, target_cache)[0]


def pair_acceptances(target, draft, pairs: Sequence[tuple[Level, Level]], prompt: Sequence[int],
                     continuations: Sequence[Sequence[int]], sampling, eagle=None, chains: Sequence[int] = (),
                     target_cache: KVCache | None = None) -> list[dict]:
  """pair_acceptance's record over each of several continuations of one prompt (a sampled
  profile's samples of it), every level's cache of the prompt built once for them all: a draft
  model's prefill and the retrieval queries, 2-3 s each at 7,680 tokens on 2 cores."""
  levels = _Levels(target, draft, prompt, _padded(max(map(len, continuations))), eagle, full=target_cache)
  measured = {n for pair in pairs for n in pair} - {EAGLE}
  levels.build_shared(measured)   # once, before _acceptance's threads share them
  return [_acceptance(levels, pairs, measured, list(prompt), list(continuation), sampling, chains)
          for continuation in continuations]


def _acceptance(levels: _Levels, pairs, measured, prompt: list[int], continuation: list[int], sampling,
                chains: Sequence[int]) -> dict:
  """pair_acceptance's record over one continuation, each level over its cache of the prompt in `levels`."""
  target = levels.target
  vocab_size = target.config.vocab_size
  dists, features, offered_counts = {}, {}, {}
  for level in filter(_is_ngram, measured):
    dists[level] = _ngram_probs(level.source, prompt, continuation, vocab_size)
    offered_counts[level] = _offered_counts(level.source, prompt, continuation)   # once, whatever verifies it

  def teacher_forced(level):
    config = levels[level][0]
    taps = levels.taps if config.num_layers == target.config.num_layers else ()  # what EAGLE may read
    return _continuation_probs(*levels[level], continuation, vocab_size, sampling, taps)

  # Two levels at a time: one is traced (Python, holding the GIL) while XLA compiles or runs the
  # other. Nothing here is timed. At 7,680 tokens: 34 s instead of 44 (docs/results/planner/first_profile_time.md).
  model_levels = [level for level in measured if not _is_ngram(level)]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for level, (probs, ranked, hidden) in zip(model_levels, pool.map(teacher_forced, model_levels)):
      dists[level], features[level] = (probs, ranked), hidden
  out = {}
  for verifier, proposer in pairs:
    p, _ = dists[verifier]
    deep = None
    if proposer == EAGLE:
      q, ranked, deep = _eagle_continuation_probs(levels, features[verifier], continuation, vocab_size, sampling)
    else:
      q, ranked = dists[proposer]
    rates = jax.device_get(_pair_rates(p, q, ranked, deep))
    record = {name: value.tolist() if value.ndim else float(value) for name, value in rates.items()}
    if _is_ngram(proposer):   # the rates count its silent positions as misses
      record["offered_counts"] = offered_counts[proposer]
      if chains:
        record["rounds"] = ngram_rounds(proposer.source, prompt, continuation, p, chains)
    else:
      del record["offered"]
    out[f"{verifier}<-{proposer}"] = record
  return out


@jax.jit
def _pair_rates(p, q, ranked, q_deep=None) -> dict:
  """A pair's rates (pair_acceptance's record) from the verifier's p [N, V], the proposer's q
  [N, V] and its top-R tokens [N, R] (-1: no such rank), in one program; q_deep [N, V]: an EAGLE
  draft's distribution as a deeper node (`_deeper`)."""
  valid = ranked >= 0                                            # an n-gram has one rank
  hits = valid & (ranked == jnp.argmax(p, axis=-1)[:, None])
  accept = jnp.sum(jnp.minimum(p, q), axis=-1)                  # [N] per position
  rates = {
      "alpha": accept.mean(),
      "greedy": hits[:, 0].mean(),
      "profile": jnp.where(valid, jnp.take_along_axis(p, jnp.maximum(ranked, 0), axis=-1), 0.0).mean(axis=0),
      "greedy_profile": hits.mean(axis=0),
      # Independence across positions (the latency model's assumption): acceptance of the
      # next position given this one was accepted, against the unconditional rates above.
      "alpha_next": jnp.sum(accept[:-1] * accept[1:]) / jnp.maximum(jnp.sum(accept[:-1]), 1e-9),
      "greedy_next": jnp.sum(hits[:-1, 0] & hits[1:, 0]) / jnp.maximum(jnp.sum(hits[:-1, 0]), 1),
      "offered": valid[:, 0].mean()}
  return rates if q_deep is None else {**rates, **_deeper(p, accept, hits[:, 0], q_deep)}


def _deeper(p, accept, hits, q_deep) -> dict:
  """An EAGLE draft's `deeper` and `greedy_deeper` (latency.accepted_law): the acceptance of its
  token as a deeper node (reading the feature it predicted the position before), given that the
  position before was accepted, relative to the overall rate at a first depth."""
  accept_deep = jnp.sum(jnp.minimum(p, q_deep), axis=-1)[1:]
  hits_deep = (jnp.argmax(q_deep, axis=-1) == jnp.argmax(p, axis=-1))[1:]
  given = lambda rate, before: jnp.sum(before * rate) / jnp.maximum(jnp.sum(before), 1e-9)
  return {"deeper": given(accept_deep, accept[:-1]) / jnp.maximum(accept.mean(), 1e-9),
          "greedy_deeper": given(hits_deep, hits[:-1]) / jnp.maximum(hits.mean(), 1e-9)}


# Bumped when what a profile holds is measured differently, so stored ones are measured again.
# 2: generations are timed from when every level's cache is built (engine.prefill); the
# overheads fitted before counted a draft's prefill as decoding. 3: CPU programs are compiled
# with 512-bit vectors (programs.CPU_DEFAULTS). 4: overheads fitted with a fifth reference stack
# (round_overheads). 5: an EAGLE draft's deeper-node acceptance (pair_acceptance's `deeper`).
# 6: an n-gram level's proposals compared with the verifier's prediction of the same token
# (they were one token early, so prompt lookup measured near 0). 7: an n-gram level offers
# nothing where no suffix matched (it proposed the last token), and its record says how often it offers.
# 8: it offers at most 2**n tokens after a match of n, and its record has the law of how many.
# 9: `ar` is timed at the profile's sampling (it was greedy: a sampled plan's baseline was too fast).
# 10: prompt lookup's rounds replayed over the continuation (pair_acceptance's `rounds`).
# 11: each continuation's acceptance kept beside the mean (auto.for_the_batch's slowest row), and
# a middle level's rounds fitted an overhead of their own (round_overheads' `middle`).
# 12: the overheads fitted with the forwards at the widths the engine runs them (latency.static_widths
# and the drafter's lead), not at the mean length they verify: the rest was charged to `middle`.
PROFILE_VERSION = 12


def profile_key(model: str, draft: str | None) -> dict:
  """What a profile is valid for: the models (their paths and contents: loading/digest.py), the
  machine and the jax that measured it."""
  from hitree_jax.loading.digest import contents_digest
  return {"version": PROFILE_VERSION, "model": model, "draft": draft,
          "contents": [contents_digest(model), draft and contents_digest(draft)], "machine": platform.machine(),
          "processor": platform.processor(),
          "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()[:1]],
          "jax": jax.__version__}


def stored(path: str | pathlib.Path, key: dict, keep: Callable[[dict], bool] = lambda profile: True) -> dict | None:
  """The profile stored at `path` if it was measured for `key` (and `keep` takes it), else None; a
  torn or corrupt file is None too, with a one-line warning (it is measured again, not a crash of
  every plan)."""
  path = pathlib.Path(path)
  if not path.exists():
    return None
  try:
    stored_key, profile = read_kept(path)
  except TORN as e:
    logging.warning("%s is not a whole planner profile (%s: %s): measuring it again", path,
                    type(e).__name__, e)
    return None
  return profile if stored_key == key and keep(profile) else None


# What reading a torn or foreign file raises: JSONDecodeError and UnicodeDecodeError are ValueErrors.
TORN = (ValueError, KeyError, TypeError)


def read_kept(path: pathlib.Path) -> tuple[dict, dict]:
  """(key, profile) of a file `cached` wrote; raises one of TORN where it is torn or not a profile."""
  record = json.loads(path.read_text())
  return record["key"], record["profile"]


def cached(path: str | pathlib.Path, key: dict, measure: Callable[[], dict],
           keep: Callable[[dict], bool] = lambda profile: True) -> dict:
  """The profile stored at `path` if it was measured for `key`, else measure() stored there:
  written to a temporary name and renamed, so an interrupted write leaves the old file whole (by
  process 0 alone of a multi-host run)."""
  path = pathlib.Path(path)
  if (profile := stored(path, key, keep)) is not None:
    return profile
  profile = measure()
  if jax.process_index() != 0:   # a multi-host run's processes measure alike; process 0 keeps it
    return json.loads(json.dumps(profile))
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  partial.write_text(json.dumps({"key": key, "profile": profile}, indent=1))
  os.replace(partial, path)
  return read_kept(path)[1]   # as a reader sees it (JSON keys are strings)
