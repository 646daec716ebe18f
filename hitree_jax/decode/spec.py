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
from typing import Sequence

from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.decode.verify import DrawMode
from hitree_jax.errors import UsageError
from hitree_jax.tree import shapes
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


# ---- the bottom level's tree (TREE) ----

TREE_FORMS = "N, chain:N, kary:KxD, sequoia:BUDGET,DEPTH or dynamic:BUDGET,DEPTH (positive integers)"


def _check_tree(tree, *sizes: int) -> None:
  """Positive sizes, and at most shapes.MAX_TREE_NODES nodes (counted without building)."""
  if min(sizes) < 1:
    raise UsageError(f"bad tree spec {str(tree)!r}: sizes must be positive; expected {TREE_FORMS}")
  if tree.nodes > shapes.MAX_TREE_NODES:
    raise UsageError(f"tree spec {str(tree)!r} asks for {tree.nodes} nodes; a round verifies at most "
                     f"{shapes.MAX_TREE_NODES}")


@dataclasses.dataclass(frozen=True)
class Chain:
  """`length` tokens in a line, sd's tree; written chain:N, or a bare N (`bare`, kept only to
  print it back as written)."""
  length: int
  bare: bool = dataclasses.field(default=False, compare=False)

  def __post_init__(self):
    _check_tree(self, self.length)

  @property
  def nodes(self) -> int:
    return self.length

  def topology(self, acceptance: Sequence[float] | None = None) -> shapes.TokenTree:
    return shapes.chain(self.length)

  def __str__(self) -> str:
    return str(self.length) if self.bare else f"chain:{self.length}"


@dataclasses.dataclass(frozen=True)
class Kary:
  """Every node has `branching` children, `depth` levels deep."""
  branching: int
  depth: int

  def __post_init__(self):
    _check_tree(self, self.branching, self.depth)

  @property
  def nodes(self) -> int:   # kary:10x10 is 10^10: counted, never built
    k, depth = self.branching, self.depth
    return depth if k == 1 else (k ** (depth + 1) - k) // (k - 1)

  def topology(self, acceptance: Sequence[float] | None = None) -> shapes.TokenTree:
    return shapes.kary(self.branching, self.depth)

  def __str__(self) -> str:
    return f"kary:{self.branching}x{self.depth}"


@dataclasses.dataclass(frozen=True)
class _Budgeted:
  """A tree of at most `budget` nodes, `depth` deep, whose shape is chosen when it is built."""
  budget: int
  depth: int

  def __post_init__(self):
    _check_tree(self, self.budget, self.depth)

  @property
  def nodes(self) -> int:
    return max(self.budget, self.depth)


@dataclasses.dataclass(frozen=True)
class Sequoia(_Budgeted):
  """Sequoia's tree of `budget` nodes at most `depth` deep, built from the drafter's per-rank
  acceptance (tree.shapes.from_acceptance)."""

  def topology(self, acceptance: Sequence[float] | None = None) -> shapes.TokenTree:
    if acceptance is None:
      raise UsageError(f"{str(self)!r}: a sequoia tree is built from the draft's acceptance profile; "
                       "give it (--acceptance, or build the tree: tree.shapes.from_acceptance)")
    return shapes.from_acceptance(acceptance, self.budget, self.depth)

  def __str__(self) -> str:
    return f"sequoia:{self.budget},{self.depth}"


@dataclasses.dataclass(frozen=True)
class Dynamic(_Budgeted):
  """EAGLE-2's tree of `budget` nodes, chosen at run time per row (tree.shapes.DynamicTree)."""

  def __post_init__(self):
    super().__post_init__()
    self.topology()   # the budget must fit the candidates the depth grows: an error naming both

  def topology(self, acceptance: Sequence[float] | None = None) -> shapes.DynamicTree:
    return shapes.DynamicTree(self.budget, self.depth)

  def __str__(self) -> str:
    return f"dynamic:{self.budget},{self.depth}"


TreeSpec = Chain | Kary | Sequoia | Dynamic


def parse_tree(text: str) -> TreeSpec:
  """TREE -> its typed value. Raises UsageError naming the text."""
  text = text.strip() if isinstance(text, str) else ""
  kind, colon, arg = text.partition(":")
  first, separator, second = (arg.partition("x") if kind == "kary" else arg.partition(","))
  if not colon and kind.isdigit():
    return Chain(int(kind), bare=True)
  if kind == "chain" and arg.isdigit():
    return Chain(int(arg))
  if kind in ("kary", "sequoia", "dynamic") and separator and first.isdigit() and second.isdigit():
    return {"kary": Kary, "sequoia": Sequoia, "dynamic": Dynamic}[kind](int(first), int(second))
  raise UsageError(f"bad tree spec {text!r}: expected {TREE_FORMS}")


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
  mode: DrawMode = DrawMode.DETERMINISTIC
  source: Source = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    object.__setattr__(self, "source", parse_source(self.name))
    object.__setattr__(self, "mode", DrawMode(self.mode))   # text given: its mode

  @classmethod
  def of(cls, source: Source, cache: Full | Streaming | None = None,
         mode: DrawMode = DrawMode.DETERMINISTIC) -> Level:
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
    return f"{self.name}{cache}" + ("" if self.mode == DrawMode.DETERMINISTIC else f",{self.mode}")


@dataclasses.dataclass(frozen=True)
class Levels:
  """A stack below the target: the drafter and its tree (its text is parsed, as a Level's name
  is), then each middle level and its gamma."""
  drafter: Level
  tree: TreeSpec
  middles: tuple[tuple[Level, int], ...] = ()

  def __post_init__(self):
    if isinstance(self.tree, str):
      object.__setattr__(self, "tree", parse_tree(self.tree))

  @property
  def levels(self) -> tuple[Level, ...]:
    return (self.drafter, *(level for level, _ in self.middles))

  def __str__(self) -> str:
    return "+".join([f"{self.drafter}/{self.tree}", *(f"{level}/{gamma}" for level, gamma in self.middles)])


def parse_level(text: str) -> Level:
  """'NAME[@full|@streaming:SxW[:reindex]][,MODE]' -> Level. Raises ValueError naming the text."""
  mode = DrawMode.DETERMINISTIC
  head, _, tail = text.rpartition(",")
  if head and tail in tuple(DrawMode):
    text, mode = head, DrawMode(tail)
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
    if level.mode != DrawMode.DETERMINISTIC:
      raise UsageError(f"level {piece!r}: a middle level hands up its own samples; no draw mode")
    if level.kind in ("ngram", "self", *FEATURE_DRAFTS):
      raise UsageError(f"level {piece!r}: {level.name} only proposes (it must be the bottom level)")
    middles.append((level, int(gamma)))
  return Levels(parse_level(who), parse_tree(tree), tuple(middles))
