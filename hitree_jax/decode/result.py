"""What a generation returns: tokens, timings, compile counts and per-level statistics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]   # generated ids per row (up to and including EOS)
  prefill_s: float
  decode_s: float
  compile_s: float          # compile time spent inside this call
  compiles: int             # programs XLA compiled inside this call
  # Speculative methods only:
  target_forwards: int | None = None           # batched target forwards in the decode loop
  rounds_per_row: list[int] | None = None      # target forwards while each row was generating
  accepted_per_depth: list[int] | None = None  # draft tokens accepted at each tree depth, all rows
  cache_loads: int = 0      # programs the persistent compilation cache served inside this call
  levels: list[dict] | None = None  # per verifying level: forwards, proposed, accepted, acceptance
  # A stack that steps aside (decode/step_aside.py): per row, the rounds it offered nothing in,
  # and how many times it stepped aside.
  aside_per_row: list[int] | None = None
  stepped_aside_per_row: list[int] | None = None
  long_caches: tuple | None = None  # every level's, with keep_long_caches (engine.generate)

  @property
  def mean_accepted(self) -> float | None:
    """Tokens committed per target forward in the decode loop, averaged over rows (ar: 1)."""
    if not self.rounds_per_row:
      return None
    per_row = [(len(t) - 1) / r for t, r in zip(self.tokens, self.rounds_per_row) if r]
    return sum(per_row) / len(per_row) if per_row else None

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens produced by the decode loop (all but the first, which prefill yields) per second."""
    n = sum(max(len(t) - 1, 0) for t in self.tokens)
    return n / self.decode_s if self.decode_s > 0 else float("nan")
