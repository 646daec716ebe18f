"""Stacks from their specs: the one place where a `--levels` spec (decode/spec.py's types)
becomes the engine's Stack of a drafter, its tree and the verifiers above it.

Methods (methods.py), the planner (planner/profile.py) and the launchers build stacks here, so
each kind of level is turned into the engine's value in one function. It sits above heads/,
whose feature drafts it builds, and below the planner and methods.

  stack = stacks.build(spec.parse("ngram:3/chain:2+draft/3"), target_config, draft_config)
"""

from __future__ import annotations

from hitree_jax.cache.kinds import Full, Retrieval
from hitree_jax.decode import spec
from hitree_jax.decode.engine import check_stack
from hitree_jax.decode.drafters import Drafter, ModelDrafter, NGramDrafter, SelfDrafter
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.errors import UsageError
from hitree_jax.model.config import ModelConfig
from hitree_jax.tree import shapes as tree_lib


def drafter(level: spec.Level, target: ModelConfig, draft: ModelConfig | None = None,
            draft_vocab=None) -> Drafter:
  """The bottom level: prompt lookup, the target's first layers, the target over a retrieval
  cache, a feature draft (its folder's heads.json says its shapes), or a draft model over its
  cache (draft: its config, draft_vocab: its model.vocab.ReducedVocab, if any)."""
  source = level.source
  if isinstance(source, spec.NGram):
    if level.mode != "deterministic":
      raise UsageError(f"level {str(level)!r}: prompt lookup proposes what it found; it draws nothing "
                       "(no draw mode)")
    return NGramDrafter(source.longest, min_ngram=source.shortest)
  if isinstance(source, spec.SelfDraft):
    return SelfDrafter(source.layers, level.mode)
  if isinstance(source, Retrieval):
    return ModelDrafter(target, level.mode, cache=source, weights="target")
  if isinstance(source, spec.FeatureDraft):
    from hitree_jax.heads import saved
    return saved.drafter(saved.read_meta(source.path, source.kind), target, level.mode)
  if draft is None:
    raise UsageError(f"level {str(level)!r} names a draft model: give its path (--draft=PATH)")
  return ModelDrafter(draft, level.mode, draft_vocab and draft_vocab.target_vocab_size,
                      cache=level.cache or Full())


def verifier(level: spec.Level, gamma: int) -> Verifier:
  """A middle level: the target over a retrieval cache, or the draft model over its cache."""
  if level.retrieval is not None:
    return Verifier("target", level.retrieval, gamma)
  return Verifier("draft", level.cache or Full(), gamma)


PLAIN = Stack()   # plain decoding (`ar`): the target alone


def build(levels: spec.Levels | str | None, target: ModelConfig, draft: ModelConfig | None = None,
          draft_vocab=None, tree: tree_lib.TokenTree | None = None, step_aside=None) -> Stack:
  """The Stack of `levels` (a spec or its text; None: PLAIN) for this target, checked against it
  from configs (before any weights load). tree: the bottom level's, where its spec alone does not
  give it (a sequoia tree is built from the draft's acceptance profile: methods.py)."""
  if levels is None:
    return PLAIN
  if isinstance(levels, str):
    levels = spec.parse(levels)
  if tree is None:
    tree = levels.tree.topology()   # a sequoia tree refuses: it needs the acceptance (methods.py)
  stack = Stack(drafter(levels.drafter, target, draft, draft_vocab), tree,
                tuple(verifier(level, gamma) for level, gamma in levels.middles),
                draft=draft, step_aside=step_aside)
  check_stack(stack, target)
  return stack
