"""A draft's vocabulary as a subset of its target's.

For a model of SmolLM2's size the 49,152-row LM head is a fifth of every
forward; a draft that only proposes the few thousand tokens that carry almost
all of book text's mass skips most of it. Verification stays exact because q,
the distribution the draft sampled from, is handed to the verifier with zeros
outside the subset.

Draft id 0 stands for "any target token outside the subset": such tokens in
the input all embed as row 0, and the draft never proposes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from hitree_jax.errors import UsageError

OTHER = 0  # draft id of every target token outside the subset


@dataclasses.dataclass(frozen=True, eq=False)
class ReducedVocab:
  target_ids: np.ndarray   # [V'] int32: the target id of each draft id; target_ids[OTHER] = -1
  target_vocab_size: int

  def __post_init__(self):
    ids = np.asarray(self.target_ids)
    kept = ids[1:]
    if ids.ndim != 1 or ids[OTHER] != -1:
      raise UsageError("target_ids must be 1-D with target_ids[0] == -1 (the 'other' token)")
    if kept.size == 0 or kept.min() < 0 or kept.max() >= self.target_vocab_size:
      raise UsageError(f"target ids must lie in [0, {self.target_vocab_size})")
    if len(np.unique(kept)) != kept.size:
      raise UsageError("target ids of a reduced vocabulary must be distinct")

  @classmethod
  def most_frequent(cls, counts: np.ndarray, size: int, always=(0, 1, 2)) -> "ReducedVocab":
    """The size-1 most frequent target tokens (plus `always`, e.g. the special tokens) + OTHER."""
    if not 2 <= size <= len(counts):
      raise UsageError(f"draft vocabulary size={size} must be in [2, {len(counts)}]")
    chosen = list(dict.fromkeys([*always, *np.argsort(-counts, kind="stable").tolist()]))[:size - 1]
    return cls(np.array([-1, *sorted(chosen)], np.int32), len(counts))

  @property
  def size(self) -> int:
    return len(self.target_ids)

  @functools.cached_property  # to_draft / coverage use it on every call
  def draft_ids(self) -> np.ndarray:
    """[target vocab] int32: the draft id of every target token (OTHER outside the subset)."""
    table = np.full(self.target_vocab_size, OTHER, np.int32)
    table[self.target_ids[1:]] = np.arange(1, self.size, dtype=np.int32)
    return table

  def to_draft(self, target_tokens):
    return self.draft_ids[np.asarray(target_tokens)]

  def to_target(self, draft_tokens):
    return self.target_ids[np.asarray(draft_tokens)]

  def coverage(self, target_tokens) -> float:
    """Fraction of target_tokens inside the subset."""
    return float(np.mean(self.to_draft(target_tokens) != OTHER))


def mask_other(logits):
  """logits [..., V'] over draft ids with OTHER at -inf: it stands for every token outside the
  subset and is never proposed."""
  return jnp.where(jnp.arange(logits.shape[-1]) == OTHER, -jnp.inf, logits)


def spread_probs(q, target_ids, target_vocab_size: int):
  """q [..., V'] over draft ids -> [..., target_vocab_size] (zero outside the subset; OTHER dropped).

  target_ids is the jnp array of ReducedVocab.target_ids (a traced argument under jit).
  """
  out = jnp.zeros(q.shape[:-1] + (target_vocab_size,), q.dtype)
  return out.at[..., jnp.maximum(target_ids[1:], 0)].set(q[..., 1:])
