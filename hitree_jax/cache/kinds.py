"""The kinds of a level's long cache, as static descriptions (hashable: jit-static): `Full`
(every committed token), `Retrieval` (TriForce's chosen chunks: cache/retrieval.py) and
`Streaming` (StreamingLLM's sinks and ring: cache/streaming.py). A stack's levels name them
(decode/stack.py), drafters build theirs from them (decode/drafters.py); this module imports
neither, so neither imports the other for them."""

from __future__ import annotations

import dataclasses

from hitree_jax.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Full:
  """Every committed token (the target's own cache)."""

  def __str__(self) -> str:
    return "full"


RETRIEVAL_CHUNK = 8   # slots per chunk that a retrieval cache scores and keeps whole (TriForce's)


@dataclasses.dataclass(frozen=True)
class Retrieval:
  """TriForce's retrieval cache: the sink chunk plus the best-scoring chunks, `budget` slots.
  reselect: choose the chunks again with the newest token's query once a row committed this many
  tokens since the last choice (checked at the end of each block, for all rows at once; 0: only
  after prefill)."""
  budget: int
  chunk: int = RETRIEVAL_CHUNK
  reselect: int = 0

  def __post_init__(self):
    if self.chunk < 1 or self.budget % self.chunk or self.budget < 2 * self.chunk:
      raise UsageError(f"retrieval budget={self.budget} must be a multiple of chunk={self.chunk} "
                       "holding at least 2 chunks (the sink and the last)")
    if self.reselect < 0:
      raise UsageError(f"retrieval reselect={self.reselect} must be >= 0 (0: never)")

  def __str__(self) -> str:
    return f"retrieval:{self.budget}" + (f":{self.reselect}" if self.reselect else "")


@dataclasses.dataclass(frozen=True)
class Streaming:
  """StreamingLLM: `sinks` first tokens plus a ring of the `window` most recent (TriForce: 16 + 234).
  reindex: the sinks sit right before the ring, as StreamingLLM's positions within the cache put
  them (cache/streaming.py); else every key keeps its sequence position."""
  sinks: int = 16
  window: int = 234
  reindex: bool = False

  def __post_init__(self):
    if self.sinks < 0 or self.window < 1:
      raise UsageError(f"streaming sinks={self.sinks} must be >= 0 and window={self.window} >= 1")

  def __str__(self) -> str:
    return f"streaming:{self.sinks}x{self.window}" + (":reindex" if self.reindex else "")


CacheKind = Full | Retrieval | Streaming
