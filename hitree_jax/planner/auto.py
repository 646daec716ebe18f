"""From measurements to a stack: the planner's candidate space, its profile, and the plan as a
--levels spec that launch.generate and launch.benchmark run.

A profile (`measure`) holds, at one context length and one sampling setting, every candidate
level's cost curve, the acceptance of every (verifier, proposer) pair that may meet in a stack,
and the engine's per-round overheads (profile.py), kept as JSON (`profiled`). `candidates`
turns it into optimize.Candidates; `choose` searches them (optimize.optimize) and weighs the
fastest stack against `ar`; `predict` scores any stack.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from typing import Sequence

import numpy as np

from hitree_jax.data import CHAT  # a profile's text: instructions in the chat template
from hitree_jax.decode import spec
from hitree_jax.errors import UsageError
from hitree_jax.decode.step_aside import CATCH_UP_CHUNK
from hitree_jax.planner import latency, optimize
from hitree_jax.planner import profile as profile_lib
from hitree_jax.tree import shapes

# A prompt is planned for the nearest profiled length; 128 is a chat question's (Spec-Bench's
# median prompt is 85 tokens).
CONTEXTS = (128, 512, 1024, 2048, 4096, 7680)
# A batch is planned for the nearest of these sizes (by ratio): a profile is measured per size.
BATCHES = (1, 2, 4, 8, 16, 32, 64)


# A level's forwards are timed at these widths in a full profile (`profiled(full=True)`, launch.plan
# --full_profile), at Space.widths otherwise: the model reads a level's cost as the line fitted
# through its points (latency.affine), and three points give the line the five give within the
# fits' own noise, in 60% of the time (docs/results/planner/quick_profile.md).
FULL_WIDTHS = (1, 2, 4, 8, 16)


# A profile's levels: the target, EAGLE (its EAGLE draft, whatever the path), the grammar's others.
TARGET, EAGLE = profile_lib.TARGET, profile_lib.EAGLE
Level, level_named = profile_lib.Level, profile_lib.level_named


@dataclasses.dataclass(frozen=True)
class Space:
  """The stacks the planner chooses among: typed levels (spec.Level; text given is parsed once,
  here), named in profiles as the --levels grammar writes them ('draft' is the --draft model,
  EAGLE an EAGLE draft: `with_eagle`); middles cheapest first (a level verifies only those before
  it). The target over a retrieval cache drafts too (TriForce's two levels, `retrieval/6`), for a
  dearer level only: the target, or a larger budget."""
  drafters: tuple[spec.Level, ...] = ("ngram:3", "self:8", "draft", "draft@streaming:16x234", "retrieval:256",
                                      "retrieval:512", "retrieval:1024")
  middles: tuple[spec.Level, ...] = ("draft@streaming:16x234", "draft", "retrieval:256", "retrieval:512",
                                     "retrieval:1024")
  chains: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
  trees: tuple[spec.TreeSpec, ...] = ("kary:2x2", "kary:2x3", "kary:3x2", "sequoia:8,4", "sequoia:16,5")
  gammas: tuple[int, ...] = (2, 3, 4, 6, 8, 12)
  widths: tuple[int, ...] = (1, 4, 16)   # timed per level; FULL_WIDTHS for a full profile

  def __post_init__(self):
    typed = lambda parse, values: tuple(parse(v) if isinstance(v, str) else v for v in values)
    object.__setattr__(self, "drafters", typed(spec.parse_level, self.drafters))
    object.__setattr__(self, "middles", typed(spec.parse_level, self.middles))
    object.__setattr__(self, "trees", typed(spec.parse_tree, self.trees))

  def for_context(self, context: int) -> "Space":
    """Without the retrieval budgets that would hold the whole context (the target itself)."""
    keep = lambda levels: tuple(level for level in levels if (level.budget or 0) < context)
    return dataclasses.replace(self, drafters=keep(self.drafters), middles=keep(self.middles))

  def with_eagle(self) -> "Space":
    """With an EAGLE draft among the drafters."""
    return self if EAGLE in self.drafters else dataclasses.replace(self, drafters=(*self.drafters, EAGLE))

  def measured(self, context: int, eagle=None) -> "Space":
    """The space a profile at `context` tokens measures: an EAGLE draft (profile.load_eagle's)
    joins it."""
    space = self.for_context(context)
    return space if eagle is None else space.with_eagle()

  def levels(self) -> list[Level]:
    return list(dict.fromkeys([*self.drafters, *self.middles, TARGET]))

  def model_levels(self) -> list[Level]:
    """The levels that run a model, whose forwards a profile times (an n-gram runs none)."""
    return [level for level in self.levels() if level == TARGET or level.kind != "ngram"]

  def pairs(self) -> list[tuple[Level, spec.Level]]:
    """(verifier, proposer): each middle and the target over each drafter and each middle before
    it (the space lists middles cheapest first); an EAGLE draft only under a level that runs the
    target's weights (the target, or it over a retrieval cache), whose features it reads; a
    retrieval level only under a level after it (it is as dear as the target's weights)."""
    out = []
    for i, verifier in enumerate([*self.middles, TARGET]):
      below = self.middles[:i]
      for proposer in dict.fromkeys([*self.drafters, *below]):
        if proposer == EAGLE and not _runs_the_targets_weights(verifier):
          continue
        if _is_retrieval(proposer) and proposer not in below:
          continue
        if proposer != verifier:
          out.append((verifier, proposer))
    return out


def _runs_the_targets_weights(level: Level) -> bool:
  return level == TARGET or _is_retrieval(level)


def _is_retrieval(level: Level) -> bool:
  return level != TARGET and level.retrieval is not None


PASSAGES = 3  # acceptance is averaged over this many passages: one passage's is off by up to 30%
# From this context on, over two: each passage costs a first plan its prefill and continuation (19 s
# of 153 at 7,680 tokens here). At 7,680 the two-passage set's mean predicted prompt lookup's chains
# within 9% of the three-passage set's, each passage alone 1.16-1.48x `ar` for the chain of 4
# (docs/results/planner/passages_at_length.md).
LONG_CONTEXT, LONG_PASSAGES = 4096, 2


def passages(context: int) -> int:
  """The book passages a profile at `context` tokens takes acceptance over."""
  return PASSAGES if context < LONG_CONTEXT else LONG_PASSAGES

# Tokens of the target's own text after a book passage, where acceptance is taken: as many as
# launch.benchmark generates. Prompt lookup matches the answer's repeats of itself, more of them
# later: replayed over the first 64 tokens of three 512-token passages it commits 1.53 tokens a
# forward (chain of 3, greedy), over all 128 1.94, as the engine does over those 128
# (docs/results/planner/ngram_replay.md).
CONTINUATION = 128
# After a chat prompt, the target's whole answer, to its end of turn or this many tokens (Spec-Bench's
# max_new_tokens): prompt lookup accepts an answer's repeats of itself, which a short piece misses.
CHAT_ANSWER = 256
# A sampled profile takes acceptance over at least this many samples of the target's text. One
# sample stands for the text's law: prompt lookup's chain of 4 replayed over one 128-token sample
# of a 512-token Austen passage at T 0.6 committed 1.19-2.02 tokens a forward (1.50 on average
# over 15), and three samples, one per passage, predicted 1.23 where the engine committed 1.49
# (docs/results/planner/ngram_replay.md).
SAMPLED_CONTINUATIONS = 9
# From this context on, four: two of each of its two passages. A long passage's samples accept
# alike: from a sampled profile at 7,680 tokens (five samples of each of two passages), every
# choice of two samples of each passage predicted within 5% of all ten and chose as they did,
# where at 4,096 tokens it was within 10% (three of each: 6%). Each sample spared saves a first
# plan at 7,680 tokens its 3.6 s decode and 3.0 s of acceptance
# (docs/results/planner/samples_at_length.md).
FEW_SAMPLES_FROM, FEW_SAMPLES = 7680, 4


def sampled_continuations(context: int) -> int:
  """The samples of the target's text a sampled profile at `context` tokens takes acceptance over."""
  return SAMPLED_CONTINUATIONS if context < FEW_SAMPLES_FROM else FEW_SAMPLES

GENERATED = 96   # tokens of each generation the overheads and `ar` are timed on, at batch 1


def measure(target, draft, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
            sampling, space: Space = Space(), repeats: int = 10, eagle=None, overheads: dict | None = None,
            ar_seconds: float | None = None, target_caches: Sequence | None = None,
            interpolate_budgets: bool = True) -> dict:
  """A profile: costs {level: {width: s}}, acceptance {"v<-p": ...}, overheads {field: s},
  ar_seconds (per token of plain decoding, measured). Acceptance is the mean over the prompts;
  the timings are taken after the first, at its length (the profile's context).
  target, draft: loading.LoadedModel; continuations: the target's own tokens after each prompt;
  eagle: profile.load_eagle's EAGLE draft, measured as the level 'eagle' (the space gets it).
  The overheads are fitted to the draft model's stacks; an EAGLE forward is charged the draft
  model's per-forward overhead. overheads: fitted already (`stored_overheads`), not fitted here;
  ar_seconds: timed already (the continuations' own decoding: `ar_from`), not timed here;
  target_caches: the target's cache of each prompt, from generating its continuation (not
  prefilled again: profile.pair_acceptance's target_cache); consecutive equal prompts (a sampled
  profile's samples) read the first one's caches; interpolate_budgets: measure_costs'."""
  space = space.measured(len(prompts[0]), eagle)
  caches = target_caches or [None] * len(prompts)
  per_passage = []
  for at in _runs_of_one_prompt(prompts):   # a sampled profile's samples of a prompt share its caches
    per_passage += profile_lib.pair_acceptances(target, draft, space.pairs(), prompts[at.start],
                                                continuations[at], sampling, eagle, space.chains, caches[at.start])
  return {"context": len(prompts[0]), "passages": len({tuple(p) for p in prompts}), "continuations": len(prompts),
          "acceptance": {pair: _mean([a[pair] for a in per_passage]) for pair in per_passage[0]},
          # each continuation's own, for a batch's slowest row (`for_the_batch`)
          "per_continuation": [{"tokens": len(c), "acceptance": a} for c, a in zip(continuations, per_passage)],
          **measure_costs(target, draft, prompts[0], sampling, space, repeats, eagle, overheads=overheads,
                          ar_seconds=ar_seconds, target_cache=caches[0], interpolate_budgets=interpolate_budgets)}


def _runs_of_one_prompt(prompts: Sequence[Sequence[int]]) -> list[slice]:
  """The runs of consecutive equal prompts, as slices (each run's continuations read one cache)."""
  starts = [i for i in range(len(prompts)) if i == 0 or list(prompts[i]) != list(prompts[i - 1])]
  return [slice(a, b) for a, b in zip(starts, starts[1:] + [len(prompts)])]


def measure_costs(target, draft, prompt: Sequence[int], sampling, space: Space = Space(), repeats: int = 10,
                  eagle=None, rows: int = 1, overheads: dict | None = None, ar_seconds: float | None = None,
                  target_cache=None, interpolate_budgets: bool = True) -> dict:
  """A profile's timings at a batch of `rows` copies of `prompt`: costs {level: {width: s}} of a
  forward of all rows, overheads {field: s} of a round of all rows, ar_seconds (a step of all
  rows at this sampling: a row's seconds per token). A row's acceptance is the same at any batch
  (each row accepts its own tokens), so a batch's profile takes it from batch 1's (`profiled`).
  overheads: {"fields": ..., "from": where} of another profile or of the shipped fits
  (`stored_overheads`): not fitted again; ar_seconds: timed already, not timed again;
  target_cache: the target's cache of `prompt` already (profile.level_costs' full);
  interpolate_budgets: the retrieval levels above the smallest budget read off the line through it
  and the target (profile.interpolated_budgets), named in the profile's `interpolated`; False
  times them too (a full profile)."""
  space = space.measured(len(prompt), eagle)
  budgets = [m.budget for m in space.middles if _is_retrieval(m)]
  costs = profile_lib.level_costs(target, draft, space.model_levels(), prompt, space.widths, repeats, eagle, rows,
                                  full=target_cache, interpolate_budgets=interpolate_budgets)
  interpolated = profile_lib.interpolated_budgets(space.model_levels()) if interpolate_budgets else []
  new_tokens = max(GENERATED // rows, 32)   # a batch's rows average its timings' noise too
  if overheads is None:
    fitted = {"overheads": profile_lib.round_overheads(target, draft, prompt, sampling, budget=min(budgets, default=256),
                                                      max_new_tokens=new_tokens, costs=costs, rows=rows)}
  else:
    fitted = {"overheads": overheads["fields"], "overheads_from": overheads["from"]}
  if ar_seconds is None:
    ar_seconds = profile_lib.ar_seconds(target, prompt, new_tokens, rows, sampling)
  return {"costs": costs, **({"interpolated": [str(level) for level in interpolated]} if interpolated else {}),
          **fitted, "ar_seconds": ar_seconds}


def ar_from(runs: Sequence) -> float | None:
  """Seconds per token of plain decoding from the target's own continuations (GenerationResults of
  one row each, at the profile's sampling and context): over every run but the first, whose
  decode loop pays its first execution (0.3-0.9 s here: docs/results/cpu/first_execution.md).
  They are `ar` itself, so a profile need not time it again (9-13 s of a first profile). None
  where they decoded nothing (answers that ended at once): it is timed then."""
  warm = runs[1:] or runs
  decoded = sum(len(r.tokens[0]) - 1 for r in warm)   # each row's first token is the prefill's
  return sum(r.decode_s for r in warm) / decoded if decoded > 0 else None


def _mean(records: Sequence):
  """Field by field, element by element: numbers, and dicts and lists of them, nested."""
  first = records[0]
  if isinstance(first, dict):
    return {k: _mean([r[k] for r in records]) for k in first}
  if isinstance(first, list):
    return [_mean(column) for column in zip(*records)]
  return sum(records) / len(records)


def _tree(tree: spec.TreeSpec, profile: Sequence[float] | None) -> shapes.TokenTree:
  """A tree of the space: Sequoia's is built for the drafter's profile against the target."""
  return tree.topology(profile if isinstance(tree, spec.Sequoia) else None)


def candidates(profile: dict, greedy: bool, space: Space = Space()) -> optimize.Candidates:
  """optimize.Candidates from a profile (as stored: JSON keys are strings); an EAGLE draft it
  measured joins the space's drafters."""
  space = space.for_context(profile["context"])
  if str(EAGLE) in profile["costs"]:
    space = space.with_eagle()
  curve = {level_named(name): latency.affine({int(w): s for w, s in points.items()})
           for name, points in profile["costs"].items()}
  per_rank, per_token, deeper, offers = {}, {}, {}, {}
  for pair, record in profile["acceptance"].items():
    verifier, proposer = map(level_named, pair.split("<-"))
    offer = record.get("offered", 1.0)   # an n-gram's (profile.py), and the law of how much it offers
    offers[verifier, proposer] = tuple(record["offered_counts"]) if "offered_counts" in record else offer
    if "rounds" in record:   # prompt lookup's rounds, replayed over the verifier's text
      offers[verifier, proposer] = latency.Replayed({int(n): np.asarray(r) for n, r in record["rounds"].items()},
                                                    offers[verifier, proposer])
    per_rank[verifier, proposer] = [r / max(offer, 1e-9) for r in record["greedy_profile" if greedy else "profile"]]
    per_token[verifier, proposer] = record["greedy" if greedy else "alpha"]
    if "deeper" in record:  # an EAGLE draft's (profile.pair_acceptance)
      deeper[verifier, proposer] = record["greedy_deeper" if greedy else "deeper"]
  drafters = []
  for level in space.drafters:
    reference = per_rank.get((TARGET, level))
    tree_specs = [spec.Chain(n) for n in space.chains]
    if level.kind != "ngram" and reference is not None and reference[0] > 0:
      tree_specs += list(space.trees)
    trees = tuple((tree, _tree(tree, reference)) for tree in tree_specs)
    drafters.append(optimize.Drafter(level, trees, curve.get(level), own_cache=level.kind != "self",
                                     keeps_tree=level != EAGLE))
  middles = tuple((m, curve[m]) for m in space.middles)
  return optimize.Candidates(tuple(drafters), middles, curve[TARGET], space.gammas, per_rank,
                             latency.Overheads(**profile["overheads"]), per_token, deeper, offers,
                             profile.get("batch", 1))


@dataclasses.dataclass(frozen=True)
class Choice:
  """A plan in the launchers' terms: the stack's levels in the profile's names (None: plain
  decoding, `ar`, when no stack is predicted to beat it), and for a Sequoia tree the per-rank
  acceptance it was built from (--acceptance). best_stack: the fastest stack, chosen or not.
  step_aside: the accepted tokens per round under which a row's round loses to a plain one
  (`step_aside_below`): its rows step aside there."""
  best_stack: optimize.Plan
  levels: spec.Levels | None
  acceptance: tuple[float, ...] | None
  predicted_tokens_per_s: float
  ar_tokens_per_s: float
  step_aside: float | None = None

  def flags(self, draft: str, eagle: str | None = None) -> dict:
    """The launchers' flags: draft is the draft model's path, eagle the EAGLE draft's (a plan
    drafting with 'eagle' names it eagle:PATH)."""
    if self.levels is None:
      return {"method": "ar"}
    levels = self.levels
    if levels.drafter == EAGLE:   # the profile's EAGLE draft, named by its path
      if eagle is None:
        raise UsageError(f"{str(levels)!r} drafts with an EAGLE draft: give its path")
      drafter = spec.Level.of(spec.FeatureDraft("eagle", eagle), levels.drafter.cache, levels.drafter.mode)
      levels = dataclasses.replace(levels, drafter=drafter)
    out = {"method": "hsd", "levels": str(levels), "draft": draft}
    if self.acceptance is not None:
      out["acceptance"] = ",".join(f"{a:.4f}" for a in self.acceptance)
    if self.step_aside is not None:
      out["step_aside"] = f"{self.step_aside:.3g}:{STEP_ASIDE_ROUNDS}:{STEP_ASIDE_MEMORY}"
    return out


def levels_of(plan: optimize.Plan) -> spec.Levels:
  """A plan's stack as levels, in the profile's names ('draft', 'eagle', 'retrieval:256', ...)."""
  return spec.Levels(plan.drafter, plan.tree, plan.middles)


MIN_GAIN = 0.10  # a stack must be predicted this much faster than `ar` to be chosen over it
MIN_BELOW = 0.05   # the least break-even a plan's rows step aside under (StepAside's must be > 0)
# A plan's rows step aside after `rounds` plain rounds when their mean over about this many rounds
# falls below the break-even. Prompt lookup accepts in bursts (nothing, then three tokens): over 4
# rounds its mean fell below a break-even of 0.49 often enough that its rows rested through
# matches, 1.84 -> 1.38 tokens per target forward and 1.34x -> 1.24x `ar` on Austen at 512 tokens;
# over 16 they kept 1.84 (1.29x, and 1.32x as `auto`), and a drafter that never pays still steps
# aside after 11 rounds (docs/results/planner/step_aside_memory_512.md).
STEP_ASIDE_ROUNDS, STEP_ASIDE_MEMORY = 16, 16


def _drafted_while_resting(level: Level) -> str:
  """What the drafter runs in a round its rows rest (step_aside.py): "nothing" (prompt lookup,
  the target's own layers, Medusa keep nothing between rounds), "lead" (a model with a cache
  of its own falls behind and catches up a chunk of tokens a forward) or "tree" (EAGLE's and
  DFlash's caches are written from what they draft: they draft as in any round)."""
  if level.kind in ("ngram", "self", "medusa"):
    return "nothing"
  return "lead" if level.kind in ("draft", "retrieval") else "tree"


def step_aside_below(c: optimize.Candidates, plan: optimize.Plan, ar_seconds: float) -> float | None:
  """The accepted tokens per round under which a row of `plan` decodes slower than it would
  resting. A round offering the drafter's whole tree costs the exact model's top round (its
  proposal, the target's forward over it and a verifying round's overheads; in a hierarchy, the
  buffer's fill too), and commits one token more than it accepts. A resting round commits
  one, at `ar`'s step where nothing under the target runs, or at a one-token forward and the
  share of a forward in which each level with a cache of its own (a draft model, a middle level)
  catches up a chunk of tokens (`_drafted_while_resting`), or, for EAGLE and DFlash, a whole
  proposal. The chunk is priced at CATCH_UP_CHUNK tokens; under a shallow stack the engine's is
  the round's extent (decode/loop.py: 8 for a chain of 2), so a rest there costs a little more
  than priced (a few percent of the break-even; the extent comes from StackSizes, which needs
  model configs that a profile's candidates do not carry). None for prompt lookup right under
  the target: a round in which it finds no match is a plain one already, and its hits come in
  runs that a running mean misses. On 7.5K tokens of Austen its chain of 2 stepped aside three
  times on one passage and committed 1.45 tokens a forward instead of 1.76, 1.07x `ar` instead of
  1.11x (docs/results/planner/auto_aside_7680_ab.json; 1.29x against 1.34x at 512 tokens). None
  too for a hierarchy over a drafter that drafts while resting: its buffer fills as in any round."""
  drafted = _drafted_while_resting(plan.drafter)
  if plan.drafter.kind == "ngram" and not plan.middles or plan.middles and drafted == "tree":
    return None
  drafter = next(d for d in c.drafters if d.name == plan.drafter)
  tree = dict(drafter.trees)[plan.tree]
  proposal = lambda t: latency.tree_draft_seconds(t, drafter.cost) + (c.overheads.propose(t) if drafter.cost else 0.0)
  chunk, middles = CATCH_UP_CHUNK, dict(c.middles)
  caught_up = sum(middles[m](chunk) for m, _ in plan.middles) + (drafter.cost(chunk) if drafted == "lead" else 0.0)
  speculating = (plan.exact or optimize.exact(c, plan)).round_seconds
  if drafted == "tree":
    resting = proposal(tree) + c.target(1) + c.overheads.check(None)
  elif caught_up:
    resting = c.target(1) + c.overheads.check(None) + caught_up / chunk
  else:
    resting = ar_seconds
  return max(speculating / resting - 1.0, MIN_BELOW)


def choose(profile: dict, greedy: bool, space: Space = Space(), min_gain: float = MIN_GAIN) -> Choice:
  """The fastest stack of the space for this profile, or `ar` unless that stack is predicted at
  least `min_gain` faster. The margin is the model's error: on SmolLM2 at 2K and 4K tokens its
  predictions were within 10% of measurement for most stacks, within 25% for all
  (docs/planner.md), and a stack predicted 8% faster than `ar` ran 12% slower."""
  c = candidates(profile, greedy, space)
  plan = _fastest_for_the_batch(profile, c, _rows(profile, greedy, space))
  stack_speed = 1.0 / plan.exact.seconds_per_token
  ar_speed = 1.0 / (profile["ar_seconds"] * _slowest_answer(profile))
  if stack_speed < (1.0 + min_gain) * ar_speed:
    return Choice(plan, None, None, ar_speed, ar_speed)
  # A Sequoia tree is built from the drafter's profile against the target (`candidates`).
  acceptance = tuple(c.profile(TARGET, plan.drafter)) if isinstance(plan.tree, spec.Sequoia) else None
  return Choice(plan, levels_of(plan), acceptance, stack_speed, ar_speed,
                step_aside_below(c, plan, profile["ar_seconds"]))


def predict(profile: dict, greedy: bool, levels: spec.Levels | str, tree: shapes.TokenTree | None = None,
            space: Space = Space()) -> latency.Prediction:
  """The model's prediction for a stack (spec.Levels, or a --levels spec) in the profile's names
  ('draft' for the draft model); tree: the bottom level's, when it is not one of the space's."""
  c = candidates(profile, greedy, space)
  parsed = spec.parse(levels) if isinstance(levels, str) else levels
  levels = str(parsed)
  names = lambda values: [str(value) for value in values]
  drafter = next((d for d in c.drafters if d.name == parsed.drafter), None)
  if drafter is None:
    raise UsageError(f"{levels!r}: the profile has no drafter {str(parsed.drafter)!r} (it has "
                     f"{names(d.name for d in c.drafters)})")
  tree = tree if tree is not None else dict(drafter.trees).get(parsed.tree)
  if tree is None:
    tree = _tree(parsed.tree, c.profile(TARGET, parsed.drafter))
  middles = parsed.middles
  if any(m not in dict(c.middles) for m, _ in middles):
    raise UsageError(f"{levels!r}: the profile has no middle level among {names(m for m, _ in middles)} "
                     f"(it has {names(m for m, _ in c.middles)})")
  model = optimize.stack_model(c, drafter, tree, middles)
  if model is None:
    raise UsageError(f"{levels!r}: the profile has no acceptance for a pair of its levels")
  return for_the_batch(profile, greedy, space, latency.predict(model), parsed.drafter, tree, middles)


def for_the_batch(profile: dict, greedy: bool, space: Space, prediction: latency.Prediction,
                  drafter: Level, tree: shapes.TokenTree, middles) -> latency.Prediction:
  """`prediction` (a stack's, from the profile's mean acceptance) for a batch of the profile's
  rows: a row's seconds per token times the rounds the batch takes over those its mean row takes.
  The batch ends when its slowest row has its tokens (latency.slowest_of over the rounds each
  profiled continuation needs, by its own acceptance). At 512 tokens of Austen, greedy, prompt
  lookup's batches took 1.13-1.23x their mean row's rounds at 4 rows and 1.25-1.59x at 16, and
  were predicted 10-24% too fast (docs/results/planner/batch_grid_512_widest.md)."""
  return _charged(profile, _rows(profile, greedy, space), prediction, drafter, tree, middles)


def _fastest_for_the_batch(profile: dict, c: optimize.Candidates, rows) -> optimize.Plan:
  """The search's fastest stack for the profile's batch, with its exact prediction charged the
  batch's slowest row (`_charged`): at one row the shortest path's; at a batch, the fastest of
  its finalists so charged: a deeper stack gains more from the mean row's acceptance, and its
  rows spread more. Ranking all of them (51-102 on SmolLM2's profiles) took 0.1 s."""
  plans = optimize.finalists(c)
  if rows is None:
    return dataclasses.replace(plans[0], exact=optimize.exact(c, plans[0]))
  charged = []
  for plan in plans:
    drafter = next(d for d in c.drafters if d.name == plan.drafter)
    exact = _charged(profile, rows, optimize.exact(c, plan), plan.drafter, dict(drafter.trees)[plan.tree], plan.middles)
    charged.append(dataclasses.replace(plan, exact=exact))
  return min(charged, key=lambda plan: plan.exact.seconds_per_token)


def _rows(profile: dict, greedy: bool, space: Space) -> list[tuple[int, optimize.Candidates]] | None:
  """Each profiled continuation's tokens and candidates from its own acceptance, where a batch
  is charged its slowest row; None where there is nothing to charge (one row, one continuation)."""
  each = profile.get("per_continuation", ())
  if profile.get("batch", 1) <= 1 or len(each) < 2:
    return None
  return [(continuation["tokens"], candidates({**profile, "acceptance": continuation["acceptance"]}, greedy, space))
          for continuation in each]


def _charged(profile: dict, rows, prediction: latency.Prediction, drafter: Level, tree: shapes.TokenTree,
             middles) -> latency.Prediction:
  """`for_the_batch` over `_rows`' candidates: a stack's rounds for each continuation, by its own
  acceptance, and the slowest of the batch's rows over their mean."""
  if rows is None:   # nothing to charge: spare the predictions
    return prediction
  rounds = []
  for tokens, c in rows:
    model = optimize.stack_model(c, next(d for d in c.drafters if d.name == drafter), tree, middles)
    rounds.append(tokens / latency.predict(model).tokens_per_target_forward)
  return dataclasses.replace(prediction, seconds_per_token=prediction.seconds_per_token * _slowest_row(profile, rounds))


def _slowest_row(profile: dict, rounds: Sequence[float]) -> float:
  """The rounds a batch of the profile's rows takes over its mean row's, from the rounds each
  profiled continuation takes (latency.slowest_of): 1 for one row, or for none or one value."""
  if not rounds:
    return 1.0
  return latency.slowest_of(profile.get("batch", 1), rounds) / float(np.mean(rounds))


def _slowest_answer(profile: dict) -> float:
  """`ar`'s `_slowest_row`: its rows take a step a token, so only answers of different lengths
  (chat, to the end of turn) make one row the slowest."""
  return _slowest_row(profile, [continuation["tokens"] for continuation in profile.get("per_continuation", ())])


def in_profile_names(levels: spec.Levels | str, draft_path: str | None, eagle_path: str | None = None) -> spec.Levels:
  """A Method's levels (spec.Levels, or their text) with the draft model's path written 'draft'
  and the EAGLE draft's eagle:PATH written 'eagle', as profiles name them."""
  from hitree_jax.loading import resolve
  def renamed(level: spec.Level) -> spec.Level:
    if draft_path is not None and _resolves_to(level.name, draft_path, resolve):
      return spec.Level.of(spec.DraftModel(), level.cache, level.mode)
    if eagle_path is not None and level.kind == "eagle" and _same_path(level.feature_draft[1], eagle_path):
      return dataclasses.replace(EAGLE, cache=level.cache, mode=level.mode)
    return level

  parsed = spec.parse(levels) if isinstance(levels, str) else levels
  return spec.Levels(renamed(parsed.drafter), parsed.tree,
                     tuple((renamed(level), gamma) for level, gamma in parsed.middles))


def _same_path(a: str, b: str) -> bool:
  return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def _resolves_to(name: str, draft_path: str, resolve) -> bool:
  try:
    return str(resolve(name)) == str(resolve(draft_path))
  except (FileNotFoundError, ValueError):
    return False


def precision(dtype: str = "float32", key_dtype: str | None = None) -> dict:
  """The target's precision as a profile records it: {} for float32 weights and caches (profiles
  measured before precision was recorded stay valid), else its dtype and key dtype. The costs
  and the acceptance both depend on it (launch --dtype, --key_dtype; ModelConfig)."""
  key_dtype = None if key_dtype == dtype else key_dtype
  return {} if (dtype, key_dtype) == ("float32", None) else {"dtype": dtype, "key_dtype": key_dtype}


def profile_path(directory: str | pathlib.Path, model: str, draft: str, context: int, sampling,
                 text: str = "austen", eagle: str | None = None, target_precision: dict | None = None,
                 batch: int = 1) -> pathlib.Path:
  """Where the profile of (models, context, text, sampling, the target's precision, batch) is kept."""
  stem = lambda path: pathlib.Path(path).name.split(".")[0]
  t, p, k = float(sampling.temperature), float(sampling.top_p), int(sampling.top_k)
  setting = "greedy" if t == 0 else f"T{t:g}-p{p:g}-k{k}"
  models = "+".join([stem(model), stem(draft), *([stem(eagle)] if eagle else [])])
  if target_precision:
    dtype, key_dtype = target_precision["dtype"], target_precision["key_dtype"]
    setting += f"-{dtype}" + (f"-keys-{key_dtype}" if key_dtype else "")
  if batch > 1:
    setting += f"-batch{batch}"
  return pathlib.Path(directory) / models / f"ctx{context}-{text}-{setting}.json"


def nearest_context(length: int) -> int:
  return min(CONTEXTS, key=lambda c: abs(c - length))


def nearest_batch(rows: int) -> int:
  """The profiled batch size nearest `rows` by ratio (BATCHES: each is timed on its own)."""
  if rows < 1:
    raise UsageError(f"a batch of {rows} rows: it must hold at least one")
  return min(BATCHES, key=lambda b: abs(math.log(b / rows)))


def default_dir() -> pathlib.Path:
  """`$HITREE_PROFILES`, else `<assets>/profiles` (beside the weights and the compilation cache)."""
  import os
  from hitree_jax.data import assets_dir
  env = os.environ.get("HITREE_PROFILES")
  return pathlib.Path(env).expanduser() if env else assets_dir() / "profiles"


def profile_key(model_path: str, draft_path: str, context: int, sampling, text: str,
                eagle_path: str | None = None, target_precision: dict | None = None, batch: int = 1) -> dict:
  """What a stored profile must have been measured for (profile.profile_key: and the machine);
  batch 1's key names no batch (profiles stored before batches were planned stay valid)."""
  key = dict(profile_lib.profile_key(model_path, draft_path), context=context, book=text,
             sampling=[float(sampling.temperature), float(sampling.top_p), int(sampling.top_k)],
             **(target_precision or {}), **({"batch": batch} if batch > 1 else {}))
  if text == CHAT:   # what a chat profile is measured on (a book profile's key predates these)
    from hitree_jax.train.instructions import OPEN_INSTRUCTIONS
    key.update(prompts=f"one per task, and {len(OPEN_INSTRUCTIONS)} open instructions at their context",
               answer_tokens=CHAT_ANSWER)
  if eagle_path is None:
    return key
  from hitree_jax.loading.digest import contents_digest
  return dict(key, eagle=eagle_path, eagle_contents=contents_digest(eagle_path))


def profiled(model: str, draft: str, context: int, sampling, directory: str | pathlib.Path | None = None,
             text: str = "austen", space: Space = Space(), loaded: tuple = (None, None),
             log=lambda message: None, eagle: str | None = None, dtype: str = "float32",
             key_dtype: str | None = None, batch: int = 1, full: bool = False) -> tuple[dict, pathlib.Path]:
  """The profile of (model, draft) at `context` tokens of `text` (a corpus, or CHAT) and this sampling, with the
  target in `dtype` and its caches' keys in `key_dtype`, for a batch of `batch` rows: stored, or
  measured and stored (one to three minutes on a 2-core CPU). loaded: the models if already in
  memory (the target in that precision); eagle: an EAGLE draft's folder, profiled too (a profile
  of its own). A batch's profile is batch 1's acceptance (profiled first, or read) with its own
  timings. A round's overheads come from a stored profile of these models at another context or
  text where there is one, else from the fits shipped for the shipped models (`stored_overheads`).
  full: the full measurement, every width of FULL_WIDTHS and every retrieval budget timed and the
  overheads fitted here (a stored profile that is not one is measured again)."""
  from hitree_jax.loading import load_model
  if loaded[0] is not None and precision(loaded[0].config.dtype, loaded[0].config.key_dtype) != precision(dtype, key_dtype):
    raise UsageError(f"the loaded target is in {loaded[0].config.dtype} with keys in "
                     f"{loaded[0].config.cache_key_dtype}, not the profile's {dtype} and {key_dtype or dtype}")
  path, key = where_kept(model, draft, context, sampling, directory, text, eagle, dtype, key_dtype, batch)
  model_path, draft_path, eagle_path = key["model"], key["draft"], key.get("eagle")
  if full:
    space = dataclasses.replace(space, widths=FULL_WIDTHS)

  @functools.cache
  def models_and_prompts():
    """(target, draft model, EAGLE draft or None, the measured prompts): loaded once, for batch 1's
    profile and a batch's alike."""
    from hitree_jax.tokenizer import load_tokenizer
    target = loaded[0] or load_model(model_path, dtype, key_dtype)
    drafter = loaded[1] or load_model(draft_path)
    feature_draft = None if eagle is None else profile_lib.load_eagle(eagle_path, target)
    return target, drafter, feature_draft, measured_prompts(load_tokenizer(target.path), text, context)

  def reused(at: pathlib.Path, at_key: dict) -> dict | None:
    return None if full else stored_overheads(at, at_key, log)

  def run():
    from hitree_jax.decode import engine
    log(f"profiling {' + '.join([model, draft, *([f'eagle:{eagle}'] if eagle else [])])} at {context} "
        f"tokens of {text} (once; kept in {single_path})")
    target, drafter, feature_draft, prompts = models_and_prompts()
    # The target's own text, as a stack meets it: sampled when the plan is for sampling.
    chat = text == CHAT
    new_tokens = CHAT_ANSWER if chat else CONTINUATION
    # Each prompt's prefill is its acceptance's too (keep_long_caches). Sampled, each prompt is
    # sampled again from its prefill (engine.generate_samples): at 7,680 tokens a batch of the
    # further samples took 151 s of a 321-s first plan (docs/results/planner/first_profile_time.md).
    more = 0 if sampling is None or sampling.greedy else -(-sampled_continuations(context) // len(prompts)) - 1
    generations = [engine.generate_samples(target.params, target.config, [p], sampling=sampling,
                                           seeds=[i + len(prompts) * k for k in range(1 + more)],
                                           max_new_tokens=new_tokens, stop_at_eos=chat, keep_long_caches=True)
                   if more else
                   [engine.generate(target.params, target.config, [p], sampling=sampling, seed=i,
                                    max_new_tokens=new_tokens, stop_at_eos=chat, keep_long_caches=True)]
                   for i, p in enumerate(prompts)]
    runs = [run for samples in generations for run in samples]
    continuations = [run.tokens[0] for run in runs]
    caches = [samples[-1].long_caches[0] for samples in generations for _ in samples]
    prompts = [p for p, samples in zip(prompts, generations) for _ in samples]
    return measure(target, drafter, prompts, continuations, sampling, space, eagle=feature_draft,
                   overheads=reused(single_path, single_key), ar_seconds=ar_from(runs), target_caches=caches,
                   interpolate_budgets=not full)

  def run_batch():
    log(f"timing {model} + {draft} at a batch of {batch} (once; kept in {path})")
    target, drafter, feature_draft, prompts = models_and_prompts()
    acceptance = {k: v for k, v in single.items() if k not in ("overheads_from", "interpolated")}  # its timings' own
    return {**acceptance, "batch": batch, "acceptance_from": str(single_path),
            **measure_costs(target, drafter, prompts[0], sampling, space, eagle=feature_draft, rows=batch,
                            overheads=reused(path, key), interpolate_budgets=not full)}

  keep = lambda profile: not full or ("overheads_from" not in profile and "interpolated" not in profile
                                      and all(str(w) in profile["costs"][str(TARGET)] for w in FULL_WIDTHS))
  if batch == 1:
    single_path, single_key = path, key
    return profile_lib.cached(path, key, run, keep), path
  if (stored_profile := profile_lib.stored(path, key, keep)) is not None:
    return stored_profile, path
  single_path, single_key = where_kept(model, draft, context, sampling, directory, text, eagle, dtype, key_dtype)
  single = profile_lib.cached(single_path, single_key, run, keep)
  return profile_lib.cached(path, key, run_batch, keep), path


# A round's overheads are the engine's own bookkeeping on this machine: the same whatever the
# text, and close whatever the context. They are noisy (`verify` 1.1-2.2 ms in three fits at 512
# tokens); borrowed from 512 at 2,048 they moved every prediction by 9% or less and left the
# choice (docs/planner.md). The fit is the dearest part of a first profile (six generations, each
# compiled: 84 of the 183 s of a first profile at 512 tokens).
OVERHEADS_IGNORE = ("context", "book", "prompts", "answer_tokens", "eagle", "eagle_contents")
# Fits shipped for the shipped target and drafts (drafts/overheads.json: their machine, jax and
# command with each), for a first profile of them on a machine that has kept none.
SHIPPED_OVERHEADS = "overheads.json"


def stored_overheads(path: pathlib.Path, key: dict, log=lambda message: None) -> dict | None:
  """{"fields": the overheads, "from": where} of the stored profile beside `path` whose key is
  `key`'s but for the context and the text (OVERHEADS_IGNORE: the same models, machine, jax,
  sampling, precision and batch), at the nearest context; where there is none, the shipped fit
  for these models' contents, sampling, precision and batch (`shipped_overheads`); else None."""
  same = lambda k: {name: value for name, value in k.items() if name not in OVERHEADS_IGNORE}
  found = []
  for other in path.parent.glob("ctx*.json"):
    if other == path:
      continue
    try:
      other_key, profile = profile_lib.read_kept(other)
      if same(other_key) == same(key) and "overheads_from" not in profile:
        found.append((abs(other_key["context"] - key["context"]), str(other), profile["overheads"]))
    except (*profile_lib.TORN, AttributeError):   # torn or not a profile: not a source
      continue
  if not found:
    return shipped_overheads(key, log)
  _, source, fields = min(found)
  log(f"a round's overheads from {source} (fitted at another context of these models)")
  return {"fields": fields, "from": source}


def shipped_key(key: dict) -> dict:
  """What a shipped fit must match of a profile's key: the models' contents (not their paths, nor
  the machine or jax: the fit names those), the sampling, the precision and the batch."""
  return {"contents": key["contents"], "sampling": key["sampling"], "batch": key.get("batch", 1),
          **{name: key[name] for name in ("dtype", "key_dtype") if name in key}}


def shipped_overheads(key: dict, log=lambda message: None) -> dict | None:
  """{"fields", "from"} of the shipped fit (drafts/overheads.json) for `key`'s models, sampling,
  precision and batch, naming the machine it was fitted on; None where none was shipped."""
  import json
  from hitree_jax import shipped
  where = shipped.file("drafts", SHIPPED_OVERHEADS)
  if not where.is_file():
    return None
  for fit in json.loads(where.read_text())["fits"]:
    if fit["key"] == shipped_key(key):
      source = f"{where.name}, shipped: fitted on {fit['measured']['cpu']} with jax {fit['measured']['jax']}"
      log(f"a round's overheads from {source} (none fitted on this machine yet: launch.plan --full_profile fits them)")
      return {"fields": fit["overheads"], "from": source}
  return None


def measured_prompts(tokenizer, text: str, context: int) -> list[list[int]]:
  """The prompts a profile is measured on: `passages(context)` passages of `context` tokens of the corpus
  `text`; or for CHAT, the text a chat model answers (Spec-Bench, generate --text=chat), in the chat
  template: one instruction of each task over a passage of the held-out books, `context` tokens
  long (train/instructions.py), and the open instructions, which have no text to copy, where
  this is the profile a question of their length is planned from (they are short). Prompt
  lookup and drafts accept very differently on these: an answer that extracts or rewrites
  copies its prompt; a summary, less; a poem, nothing."""
  if text == CHAT:
    from hitree_jax.tokenizer import chat_prompt
    from hitree_jax.train import instructions
    windows, _ = instructions.chat_windows(tokenizer, "eval", context + 1, len(instructions.TASKS), context)
    open_prompts = [list(chat_prompt(tokenizer, text)) for text in instructions.OPEN_INSTRUCTIONS]
    return ([row[:context].tolist() for row in windows]
            + [p for p in open_prompts if nearest_context(len(p)) == context])
  from hitree_jax.data import book_prompts
  return book_prompts(tokenizer, context, passages(context), corpus=text)


def where_kept(model: str, draft: str, context: int, sampling, directory=None, text: str = "austen",
               eagle: str | None = None, dtype: str = "float32",
               key_dtype: str | None = None, batch: int = 1) -> tuple[pathlib.Path, dict]:
  """(where the profile of these models and settings is kept, the key it was measured for)."""
  from hitree_jax.loading import resolve
  model_path, draft_path = str(resolve(model)), str(resolve(draft))
  eagle_path = None if eagle is None else str(pathlib.Path(eagle).resolve())
  target_precision = precision(dtype, key_dtype)
  path = profile_path(directory or default_dir(), model_path, draft_path, context, sampling, text, eagle_path,
                      target_precision, batch)
  return path, profile_key(model_path, draft_path, context, sampling, text, eagle_path, target_precision, batch)


def stored_plan(model: str, draft: str, prompt_length: int, sampling, directory=None, text: str = "austen",
                dtype: str = "float32", key_dtype: str | None = None,
                batch: int = 1) -> tuple[dict, pathlib.Path] | None:
  """(the profile, its path) that `plan_for` would plan from, if it was measured already; None
  where it was not (nothing is measured here)."""
  path, key = where_kept(model, draft, nearest_context(prompt_length), sampling, directory, text,
                         dtype=dtype, key_dtype=key_dtype, batch=nearest_batch(batch))
  profile = profile_lib.stored(path, key)
  return None if profile is None else (profile, path)


def plan_for(model: str, draft: str, prompt_length: int, sampling, directory=None, text: str = "austen",
             loaded: tuple = (None, None), log=lambda message: None,
             min_gain: float = MIN_GAIN, eagle: str | None = None, dtype: str = "float32",
             key_dtype: str | None = None, batch: int = 1, full: bool = False
             ) -> tuple[Choice, dict, pathlib.Path]:
  """(the fastest stack, the profile, its path) for a batch of `batch` prompts of `prompt_length`
  tokens: planned from the profile at the nearest of CONTEXTS and of BATCHES (and the target's
  precision, as in `profiled`), measured on first use; eagle: an EAGLE draft's folder, a
  candidate drafter too; full: the full measurement, as in `profiled`."""
  profile, path = profiled(model, draft, nearest_context(prompt_length), sampling, directory, text,
                           loaded=loaded, log=log, eagle=eagle, dtype=dtype, key_dtype=key_dtype,
                           batch=nearest_batch(batch), full=full)
  return choose(profile, float(sampling.temperature) == 0, min_gain=min_gain), profile, path


def break_even(profile: dict, greedy: bool, middle: spec.Level | str, space: Space = Space(),
               steps: int = 20) -> float | None:
  """HSD's question, with this profile's costs: the lowest acceptance, by the target, of `middle`'s
  tokens at which a stack with `middle` (a level, or its name) under the target beats every stack
  without it (bisection over that acceptance, everything else as measured); None if it does not
  even at 1.0."""
  middle = spec.parse_level(middle) if isinstance(middle, str) else middle
  c = candidates(profile, greedy, space)
  without = dataclasses.replace(c, middles=tuple(m for m in c.middles if m[0] != middle))
  best_without = optimize.optimize(without).seconds_per_token

  def pays(a: float) -> bool:
    ranks = {k: ([a] + [0.0] * 7 if k == (TARGET, middle) else v) for k, v in c.acceptance.items()}
    per_token = {k: (a if k == (TARGET, middle) else v) for k, v in c.buffer_acceptance.items()}
    tops = tuple(m for m in c.middles if m[0] != middle) + tuple(m for m in c.middles if m[0] == middle)
    plan = optimize.optimize(dataclasses.replace(c, acceptance=ranks, buffer_acceptance=per_token, middles=tops))
    return bool(plan.middles) and plan.middles[-1][0] == middle and plan.seconds_per_token < best_without

  if not any(m == middle for m, _ in c.middles) or not pays(1.0):
    return None
  low, high = 0.0, 1.0
  for _ in range(steps):
    mid = (low + high) / 2
    low, high = (low, mid) if pays(mid) else (mid, high)
  return high
