"""The engine's public seam: check a stack, prefill its levels, run its decode loop.

  prefill(...) -> Prefilled   checks the stack; every level's long cache from the prompts
                              (long_caches.py)
  decode(prefilled)           the jitted loop over them (loop.py, where the levels' rounds
                              are described); the long caches are donated
  generate(...)               both, timed, with each level's report
  generate_samples(...)       plain decoding once per seed from one prefill

The rest of decode/: sizes.py (a stack's static sizes, StackSizes), timing.py (each level's
round alone), and the parts the loop is built of (drafters, levels, verify, sampling).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hitree_jax import sharding
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode import programs as programs_lib
from hitree_jax.decode import timing
from hitree_jax.decode.drafters import DraftWeights
from hitree_jax.decode.long_caches import prefill_levels
from hitree_jax.decode.loop import DecodeStart, Stats, Weights, decode_loop
from hitree_jax.decode.result import GenerationResult
from hitree_jax.decode.sampling import SamplingParams
from hitree_jax.decode.sizes import StackSizes, decode_shapes
from hitree_jax.cache.kinds import Retrieval
from hitree_jax.decode.stack import Stack
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree.shapes import DynamicTree, TokenTree

@dataclasses.dataclass(frozen=True)
class Prefilled:
  """A generation after prefill, ready for `decode`: the stack's sizes, the placed weights,
  every level's long cache (donated to the decode loop: used once), and the loop's start."""
  sizes: StackSizes
  weights: Weights
  long_caches: tuple
  start: DecodeStart
  max_new_tokens: int


def check_stack(stack: Stack, config: ModelConfig) -> None:
  """Refuses a stack that cannot run on this target (from configs: before any weights load)."""
  if stack.drafter is not None:
    stack.drafter.check(stack.tree, config)
    stack.drafter.check_above(stack.verifiers[0].weights if stack.verifiers else "target")


def prefill(params, config: ModelConfig, prompts, max_new_tokens: int, stack: Stack,
            sampling: SamplingParams | None = None, seed: int = 0, stop_at_eos: bool = True,
            draft: DraftWeights | None = None, programs: programs_lib.Programs | None = None,
            mesh: Mesh | None = None, size_caches_for: int = 0) -> tuple[Prefilled, float]:
  """Checks the stack and prefills every level's long cache from the prompts: (the generation
  ready for `decode`, prefill seconds, compilation included). size_caches_for: generate's."""
  programs = programs or programs_lib.shared()
  sampling = sampling or SamplingParams.create()
  check_stack(stack, config)
  if stack.uses_draft_weights and draft is None:
    raise UsageError("a stack with a draft model needs its weights: pass "
                     "draft=DraftWeights.create(params, vocab)")
  if (stack.draft_config is not None and draft.target_ids is None
      and stack.draft_config.vocab_size != config.vocab_size):
    raise UsageError(f"draft and target vocabularies differ: the draft's has "
                     f"{stack.draft_config.vocab_size} tokens, the target's {config.vocab_size}")
  if not stack.uses_draft_weights:
    draft = None
  batch = prefill_lib.make_batch(prompts, config, max_new_tokens, size_caches_for)
  shapes = decode_shapes(stack, config, batch.tokens.shape[1], max_new_tokens, batch.batch, mesh)
  sizes = shapes.sizes
  weights = Weights(sharding.place_params(params, mesh), sharding.place_draft(draft, sizes.draft_weights_config, mesh))
  start = time.perf_counter()
  prefilled, longs = prefill_levels(sizes, weights, config, batch, shapes.slots, shapes.tail, programs)
  # Every level's cache, not only the target's first logits: a draft's prefill still running
  # when the decode clock starts was counted as decoding (a draft stack at 7.5K: 28 tok/s, not 40).
  jax.block_until_ready((prefilled, longs))
  prefill_s = time.perf_counter() - start
  seq = np.zeros((batch.batch, shapes.history), np.int32)
  seq[:, :batch.tokens.shape[1]] = batch.tokens
  eos = jnp.int32(config.eos_token_id if stop_at_eos and config.eos_token_id is not None else -1)
  start = DecodeStart(prefilled, sampling, eos, jax.random.key(seed), jnp.asarray(seq), jnp.asarray(batch.lengths))
  return Prefilled(sizes, weights, longs, start, max_new_tokens), prefill_s


def decode(ready: Prefilled, programs: programs_lib.Programs | None = None):
  """Runs the decode loop of a prefilled generation: (tokens [B, N + slack], n_tokens [B],
  Stats, the long caches after it). Its caches are donated: a Prefilled decodes once."""
  return decode_program(ready, programs)(ready.weights, ready.long_caches, ready.start)


def decode_program(ready: Prefilled, programs: programs_lib.Programs | None = None):
  """The compiled decode loop for a prefilled generation's sizes and shapes (compiled once,
  kept in `programs`), called as program(weights, long_caches, start)."""
  programs = programs or programs_lib.shared()
  inputs = (ready.weights, ready.long_caches, ready.start)
  return programs.get(("engine", ready.sizes, ready.max_new_tokens, programs_lib.shape_key(inputs)),
                      decode_loop, ready.sizes, *inputs, ready.max_new_tokens)


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             stack: Stack | None = None, tree: TokenTree | DynamicTree | None = None, drafter=None,
             sampling: SamplingParams | None = None, seed: int = 0, stop_at_eos: bool = True,
             draft: DraftWeights | None = None, programs: programs_lib.Programs | None = None,
             time_levels: bool = False, mesh: Mesh | None = None,
             keep_long_caches: bool = False, size_caches_for: int = 0) -> GenerationResult:
  """Generation with any stack (stack.py): by default `ar`; `tree` + `drafter` is shorthand for
  the two-level Stack(drafter, tree). draft: a draft model's weights, for a stack that has one.
  programs: the memo of compiled programs to use and fill (default: programs.shared()).
  time_levels: also time one round of each level alone, after prefill and before decoding (it
  compiles a program per level), and report each level's estimated share of the decode time.
  mesh: the devices to run on (sharding.make_mesh): the target tensor-parallel over `model`, rows
  over `data`, the full caches' slots over `sequence`; the tokens are the same as on one device.
  keep_long_caches: also return every level's long cache as decoding left it (its slots up to
  the prompt's length as prefill wrote them: the planner's profile reads the prompt's again).
  size_caches_for: size the caches and programs for prompts of up to this many tokens (a longer
  batch is sized for itself), so that one decode program serves every batch up to it. Where
  compiling is slow and a step costs about the same over more slots (a GPU at short contexts:
  docs/accelerators.md) that saves a program per prompt bucket; on a CPU a step reads every slot."""
  if stack is None:
    stack = Stack(drafter, tree)
  programs = programs or programs_lib.shared()
  counts_before = programs.counts()
  with sharding.use(mesh):  # traced under the mesh: attention over a cache split by slot reads it per shard
    ready, prefill_s = prefill(params, config, prompts, max_new_tokens, stack, sampling, seed,
                               stop_at_eos, draft, programs, mesh, size_caches_for)
    sizes = ready.sizes
    prefill_s -= programs.compile_s - counts_before[0]
    round_s = timing.time_levels(programs, ready) if time_levels and sizes.top > 0 else None
    out, n_tokens, stats, long_caches, decode_s = _timed_decode(ready, programs)
  return _result(ready, len(prompts), prefill_s, decode_s, out, n_tokens, stats,
                 programs.since(counts_before), round_s, long_caches if keep_long_caches else None)


def generate_samples(params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int],
                     max_new_tokens: int, sampling: SamplingParams, stop_at_eos: bool = True,
                     programs: programs_lib.Programs | None = None,
                     keep_long_caches: bool = False) -> list[GenerationResult]:
  """Plain decoding of the same prompts once per seed, from one prefill: a result per seed, as
  generate(..., seed=s) gives it. Each later sample decodes from the cache the one before
  returned, its length set back to the prompt's (decoding writes only past the prompt's slots,
  and reads nothing past a row's length): n samples of a 7.5K-token prompt cost one prefill, not
  n (15 s each on 2 cores), and one program. A later result's prefill_s is 0; keep_long_caches:
  the last result keeps the cache as its decode left it (the earlier ones were decoded from
  again, their buffers donated)."""
  if not seeds:
    raise UsageError("generate_samples needs at least one seed")
  if sampling.greedy:
    raise UsageError("generate_samples draws samples: greedy decoding gives every seed the same tokens")
  programs = programs or programs_lib.shared()
  results = []
  counts_before = programs.counts()
  ready, prefill_s = prefill(params, config, prompts, max_new_tokens, Stack(), sampling, seeds[0], stop_at_eos,
                             programs=programs)
  prefill_s -= programs.compile_s - counts_before[0]
  for i, seed in enumerate(seeds):
    out, n_tokens, stats, long_caches, decode_s = _timed_decode(ready, programs)
    last = i == len(seeds) - 1
    results.append(_result(ready, len(prompts), prefill_s, decode_s, out, n_tokens, stats,
                           programs.since(counts_before), None, long_caches if keep_long_caches and last else None))
    counts_before, prefill_s = programs.counts(), 0.0
    if not last:   # the caches it returned, back at the prompts' lengths (a copy: they are donated); the next key
      again = tuple(long.replace(lengths=jnp.copy(ready.start.end)) for long in long_caches)
      ready = dataclasses.replace(ready, long_caches=again,
                                  start=dataclasses.replace(ready.start, key=jax.random.key(seeds[i + 1])))
  return results


def _timed_decode(ready: Prefilled, programs: programs_lib.Programs):
  """decode(ready), its program compiled before the clock starts: (tokens and counts fetched to
  the host, Stats, the long caches, decode seconds)."""
  loop = decode_program(ready, programs)
  start = time.perf_counter()
  out, n_tokens, stats, long_caches = loop(ready.weights, ready.long_caches, ready.start)
  out, n_tokens = sharding.fetch(out), sharding.fetch(n_tokens)
  return out, n_tokens, stats, long_caches, time.perf_counter() - start


def _result(ready: Prefilled, rows: int, prefill_s: float, decode_s: float, out, n_tokens, stats: Stats,
            counts: dict, round_s: list[float] | None, long_caches) -> GenerationResult:
  """A decoded generation's GenerationResult (out, n_tokens fetched to the host already)."""
  sizes = ready.sizes
  stats = jax.tree.map(sharding.fetch, stats)
  speculative = sizes.top > 0
  return GenerationResult(
      tokens=[out[b, :n_tokens[b]].tolist() for b in range(rows)],
      prefill_s=prefill_s, decode_s=decode_s, **counts,
      target_forwards=int(stats.rounds.max()) if speculative else None,
      rounds_per_row=stats.rounds.tolist() if speculative else None,
      accepted_per_depth=stats.per_depth.tolist() if speculative else None,
      levels=level_report(sizes, stats, round_s, decode_s) if speculative else None,
      long_caches=long_caches,
      **({"aside_per_row": stats.aside.tolist(), "stepped_aside_per_row": stats.stepped_aside.tolist()}
         if sizes.stack.step_aside is not None else {}))


def level_report(sizes: StackSizes, stats: Stats, round_s: list[float] | None = None,
                 decode_s: float | None = None) -> list[dict]:
  """Per verifying level: what it was proposed, accepted and how many forwards it ran; `alpha`,
  the per-token acceptance (accepted / (accepted + rounds that stopped short): each token tried
  is accepted, or is the rejection that ends its round; TriForce's "acceptance rate"); with
  round_s (timing.time_levels), the time of one of its rounds and the share of decode_s its rounds
  took (forwards x round time), and for level 1 the same of the drafter's proposals."""
  names = [str(sizes.stack.drafter), *map(str, sizes.stack.verifiers), "target"]
  report = []
  for j in range(1, sizes.top + 1):
    proposed, accepted, forwards = int(stats.proposed[j]), int(stats.accepted[j]), int(stats.forwards[j])
    tried = accepted + int(stats.stopped[j])
    entry = dict(level=j, name=names[j], proposer=names[j - 1], forwards=forwards,
                 proposed=proposed, accepted=accepted, acceptance=accepted / proposed if proposed else None,
                 alpha=accepted / tried if tried else None)
    kinds = [("reselections", j)] + ([("proposer_reselections", 0)] if j == 1 else [])
    for key, at in kinds:  # the drafter has no entry of its own: level 1 reports for it
      kind = sizes.levels[at].cache
      if isinstance(kind, Retrieval) and kind.reselect:
        entry[key] = int(stats.reselected[at])
    if round_s is not None:
      entry.update(round_ms=1e3 * round_s[j], time_share=forwards * round_s[j] / decode_s)
      if j == 1:  # every round of level 1 verified one proposal of the drafter
        entry.update(proposer_round_ms=1e3 * round_s[0], proposer_time_share=forwards * round_s[0] / decode_s)
    report.append(entry)
  return report
