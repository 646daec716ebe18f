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
class NGram:
  """Prompt lookup: what followed the latest earlier match of the last `shortest`..`longest`
  tokens (decode/drafters.py NGramDrafter)."""
  longest: int = 3
  shortest: int = 1

  def __str__(self) -> str:
    return f"ngram:{self.longest}" if self.shortest == 1 else f"ngram:{self.shortest}-{self.longest}"


@dataclasses.dataclass(frozen=True)
class SelfDraft:
  """The target's own first `layers` layers, its final norm and LM head."""
  layers: int

  def __str__(self) -> str:
    return f"self:{self.layers}"


@dataclasses.dataclass(frozen=True)
class DraftModel:
  """A separate draft model: its path or shipped name, or None for `draft` (the --draft model)."""
  path: str | None = None

  def __str__(self) -> str:
    return self.path or "draft"


@dataclasses.dataclass(frozen=True)
class FeatureDraft:
  """A draft on the target's features, kind one of FEATURE_DRAFTS, in the folder `path` ("" in
  the planner's level names, where the draft is given beside them)."""
  kind: str
  path: str = ""

  def __str__(self) -> str:
    return f"{self.kind}:{self.path}" if self.path else self.kind


# Who runs a level. A retrieval level is the target over its retrieval cache, so its kind is the
# cache's (cache/kinds.py Retrieval, printed as the grammar writes it).
Source = NGram | SelfDraft | DraftModel | FeatureDraft | Retrieval


def parse_source(name: str) -> Source:
  """A level's NAME -> its typed source. Raises UsageError naming the text."""
  kind, colon, arg = name.partition(":")
  if kind == "ngram":
    shortest, dash, longest = arg.rpartition("-")
    if not colon:
      return NGram()
    if longest.isdigit() and (shortest.isdigit() or not dash):
      return NGram(int(longest), int(shortest) if dash else 1)
    raise UsageError(f"{name!r}: expected ngram, ngram:N or ngram:MIN-MAX (the match lengths it looks up)")
  if kind == "self":
    if arg.isdigit():
      return SelfDraft(int(arg))
    raise UsageError(f"{name!r}: expected self:K (the target's first K layers)")
  if kind == "retrieval":
    budget, _, every = arg.partition(":")
    if not budget.isdigit() or not (every.isdigit() or not every):
      raise UsageError(f"{name!r}: expected retrieval:BUDGET or retrieval:BUDGET:RESELECT "
                       "(positive integers: slots, and tokens between re-selections)")
    return Retrieval(int(budget), reselect=int(every or 0))
  if kind in FEATURE_DRAFTS:
    return FeatureDraft(kind, arg)
  return DraftModel(None if name == "draft" else name)


@dataclasses.dataclass(frozen=True)
class Level:
  """Who runs a level (`name` as written, `source` its typed value), the cache it keeps (None:
  its kind's own) and, for the bottom level, how it draws children."""
  name: str
  cache: Full | Streaming | None = None
  mode: str = "deterministic"
  source: Source = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    object.__setattr__(self, "source", parse_source(self.name))

  @classmethod
  def of(cls, source: Source, cache: Full | Streaming | None = None, mode: str = "deterministic") -> Level:
    """A level from its typed source, named as the grammar writes it."""
    return cls(str(source), cache, mode)

  @property
  def kind(self) -> str:
    """ngram, self, retrieval, eagle, eagle3, medusa, dflash or draft (the --draft model, or a
    draft model's path)."""
    if isinstance(self.source, FeatureDraft):
      return self.source.kind
    return {NGram: "ngram", SelfDraft: "self", DraftModel: "draft", Retrieval: "retrieval"}[type(self.source)]

  @property
  def retrieval(self) -> Retrieval | None:
    """The retrieval cache a `retrieval:BUDGET[:RESELECT]` level keeps (None for other kinds)."""
    return self.source if isinstance(self.source, Retrieval) else None

  @property
  def budget(self) -> int | None:
    retrieval = self.retrieval
    return None if retrieval is None else retrieval.budget

  @property
  def feature_draft(self) -> tuple[str, str] | None:
    """(eagle, eagle3, medusa or dflash, PATH) for a draft on the target's features."""
    source = self.source
    return (source.kind, source.path) if isinstance(source, FeatureDraft) else None

  def __str__(self) -> str:
    cache = "" if self.cache is None else f"@{self.cache}"
    return f"{self.name}{cache}" + ("" if self.mode == "deterministic" else f",{self.mode}")


@dataclasses.dataclass(frozen=True)
class Levels:
  """A stack below the target: the drafter and its tree, then each middle level and its gamma."""
  drafter: Level
  tree: str
  middles: tuple[tuple[Level, int], ...] = ()

  @property
  def tree_spec(self) -> str:
    """The bottom level's tree as tree.shapes.parse_tree_spec reads it (a bare N is chain:N)."""
    return f"chain:{self.tree}" if self.tree.isdigit() else self.tree

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
  level = Level(name, cache, mode)   # parses its source, naming a bad one
  if cache is not None and level.kind != "draft":
    raise UsageError(f"level {text!r}: {level.name} keeps no cache of its own to choose")
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
