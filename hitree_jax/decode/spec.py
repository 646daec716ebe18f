"""The --levels grammar as types: a stack's levels, parsed once, printed back as written.

  LEVELS  = BOTTOM ("+" MIDDLE)*                  bottom-up; the target on top is implicit
  BOTTOM  = LEVEL "/" TREE                        TREE: N, chain:N, kary:KxD, sequoia:B,D, dynamic:B,D
  MIDDLE  = LEVEL "/" GAMMA                       a level that buffers GAMMA tokens for the one above
  LEVEL   = NAME ["@" CACHE] ["," MODE]
  NAME    = ngram[:N | :MIN-MAX] | self:K | retrieval:BUDGET[:RESELECT] | eagle:PATH | eagle3:PATH | medusa:PATH | dflash:PATH | draft | PATH
  CACHE   = full | streaming:SINKSxWINDOW[:reindex]
  MODE    = deterministic | iid | without_replacement

e.g. `ngram:3/chain:2+draft/3+retrieval:1024/6` or
`drafts/smollm2-draft.gguf@streaming:16x234/chain:1+retrieval:1024/6` (TriForce).
`str(parse(text)) == text` for every text written in this form (docs/methods.md's examples
are tested), so a spec can be stored, compared and printed as the user wrote it. Whether the
named files exist and the levels fit a target is for the code that builds the stack.
"""

from __future__ import annotations

import dataclasses

from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.errors import UsageError

DRAW_MODES = ("iid", "without_replacement", "deterministic")   # how a drafter draws children (verify.py)
FEATURE_DRAFTS = ("eagle", "eagle3", "medusa", "dflash")  # drafts on the target's features, read by heads/saved.py


@dataclasses.dataclass(frozen=True)
class Level:
  """Who runs a level: its name, the cache it keeps (None: its kind's own) and, for the bottom
  level, how it draws children."""
  name: str
  cache: Full | Streaming | None = None
  mode: str = "deterministic"

  @property
  def kind(self) -> str:
    """ngram, self, retrieval, eagle, eagle3, medusa, dflash or draft (the --draft model, or a
    draft model's path)."""
    for kind in ("ngram", "self", "retrieval", *FEATURE_DRAFTS):
      if self.name == kind or self.name.startswith(kind + ":"):
        return kind
    return "draft"

  @property
  def retrieval(self) -> Retrieval | None:
    """The retrieval cache a `retrieval:BUDGET[:RESELECT]` level keeps (None for other kinds)."""
    if self.kind != "retrieval":
      return None
    budget, _, every = self.name.removeprefix("retrieval:").partition(":")
    if not budget.isdigit() or not (every.isdigit() or not every):
      raise UsageError(f"{self.name!r}: expected retrieval:BUDGET or retrieval:BUDGET:RESELECT "
                       "(positive integers: slots, and tokens between re-selections)")
    return Retrieval(int(budget), reselect=int(every or 0))

  @property
  def budget(self) -> int | None:
    retrieval = self.retrieval
    return None if retrieval is None else retrieval.budget

  @property
  def feature_draft(self) -> tuple[str, str] | None:
    """(eagle, eagle3, medusa or dflash, PATH) for a draft on the target's features."""
    return (self.kind, self.name.partition(":")[2]) if self.kind in FEATURE_DRAFTS else None

  def __str__(self) -> str:
    cache = "" if self.cache is None else "@" + ("full" if isinstance(self.cache, Full) else
                                                  f"streaming:{self.cache.sinks}x{self.cache.window}"
                                                  + (":reindex" if self.cache.reindex else ""))
    return f"{self.name}{cache}" + ("" if self.mode == "deterministic" else f",{self.mode}")


@dataclasses.dataclass(frozen=True)
class Levels:
  """A stack below the target: the drafter and its tree, then each middle level and its gamma."""
  drafter: Level
  tree: str
  middles: tuple[tuple[Level, int], ...] = ()

  @property
  def levels(self) -> tuple[Level, ...]:
    return (self.drafter, *(level for level, _ in self.middles))

  def __str__(self) -> str:
    return "+".join([f"{self.drafter}/{self.tree}", *(f"{level}/{gamma}" for level, gamma in self.middles)])


def parse_level(text: str) -> Level:
  """'NAME[@full|@streaming:SxW[:reindex]][,MODE]' -> Level. Raises ValueError naming the text."""
  mode = "deterministic"
  head, _, tail = text.rpartition(",")
  if head and tail in DRAW_MODES:
    text, mode = head, tail
  name, at, cache_text = text.rpartition("@")
  if not at:
    name, cache = text, None
  elif cache_text == "full":
    cache = Full()
  else:
    reindex = cache_text.endswith(":reindex")
    sinks, _, window = cache_text.removesuffix(":reindex").removeprefix("streaming:").partition("x")
    if not cache_text.startswith("streaming:") or not (sinks.isdigit() and window.isdigit()):
      raise UsageError(f"cache {cache_text!r}: expected full or streaming:SINKSxWINDOW[:reindex] "
                       "(e.g. streaming:16x234)")
    cache = Streaming(int(sinks), int(window), reindex)
  if not name:
    raise UsageError(f"level {text!r}: name its drafter or model")
  level = Level(name, cache, mode)
  if cache is not None and level.kind != "draft":
    raise UsageError(f"level {text!r}: {level.name} keeps no cache of its own to choose")
  level.retrieval  # noqa: B018 (raises on a bad budget, naming it)
  return level


def parse(text: str) -> Levels:
  """A --levels spec -> Levels. Raises ValueError naming the piece that is wrong."""
  bottom, *middle = text.split("+")
  who, _, tree = bottom.rpartition("/")
  if not who or not tree:
    raise UsageError(f"level {bottom!r}: expected DRAFTER/TREE (e.g. ngram:3/chain:2)")
  middles = []
  for piece in middle:
    name, _, gamma = piece.rpartition("/")
    if not name or not gamma.isdigit():
      raise UsageError(f"level {piece!r}: expected retrieval:BUDGET/GAMMA or draft[@streaming:SxW]/GAMMA")
    level = parse_level(name)
    if level.mode != "deterministic":
      raise UsageError(f"level {piece!r}: a middle level hands up its own samples; no draw mode")
    if level.kind in ("ngram", "self", *FEATURE_DRAFTS):
      raise UsageError(f"level {piece!r}: {level.name} only proposes (it must be the bottom level)")
    middles.append((level, int(gamma)))
  return Levels(parse_level(who), tree, tuple(middles))
