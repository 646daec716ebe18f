"""Decoding methods by name: the presets (`ar`, `sd`, `tree`, `retrieval`, `triforce`, `hitree`,
`hsd`) as one typed spec each (decode/spec.py), built into a Stack once the draft is known;
and `auto`, the planner's choice (auto_method). The launchers' --method flag and this
module's `method` take the same text:

  from hitree_jax import methods
  m = methods.method("triforce", draft="drafts/smollm2-draft.gguf", budget=1024)
  m = m.load_draft(model.config, model.params)       # reads the draft, builds the Stack
  out = m.generate(model.params, model.config, prompts, max_new_tokens=64)

`sd/ngram/4`, `tree/self:8/kary:2x2`, `hitree/drafts/smollm2-draft.gguf/kary:3x2` and
`hsd/ngram:3/chain:2+draft/4+retrieval:1024/6` name their parts inline (docs/methods.md);
the parts they leave out come from the options (`Knobs`, the flags' defaults).
"""

from __future__ import annotations

import dataclasses
import logging

from hitree_jax import shipped
from hitree_jax.decode import spec as spec_lib
from hitree_jax.errors import UsageError
from hitree_jax.tree.shapes import TokenTree

METHODS = ("ar", "sd", "tree", "retrieval", "triforce", "hitree", "hsd")

# The options (Knobs fields; the launchers' flags of the same names) each method reads: any
# other one given is a mistake, which would be ignored.
OPTIONS = {
    "ar": (),
    "sd": ("draft", "gamma", "step_aside"),
    "tree": ("draft", "tree", "acceptance", "step_aside"),
    "retrieval": ("gamma", "budget", "reselect"),
    "triforce": ("draft", "budget", "reselect", "sinks", "window", "gamma1", "gamma2"),
    "hitree": ("draft", "tree", "acceptance", "budget", "reselect", "sinks", "window", "gamma2"),
    "hsd": ("draft", "levels", "acceptance", "step_aside"),
    "auto": ("draft", "feature_draft"),
}


@dataclasses.dataclass(frozen=True)
class Knobs:
  """The speculation flags a method spec leaves out (defaults as the flags')."""
  draft: str = "self:8"
  gamma: int = 4
  tree: str | None = None
  acceptance: str | None = None
  budget: int = 1024
  reselect: int = 0
  sinks: int = 16
  window: int = 234
  gamma1: int | None = None
  gamma2: int | None = None
  levels: str | None = None
  step_aside: str | None = None   # BELOW[:ROUNDS[:MEMORY]] (decode/step_aside.py)


def method(spec: str = "ar", greedy: bool = True, **options) -> "Method":
  """The method `spec` names, as --method spells it, with its options as keywords (Knobs'
  fields: draft, gamma, tree, acceptance, budget, reselect, sinks, window, gamma1, gamma2,
  levels, step_aside). An option the method does not read is refused, naming it. `greedy` picks the
  greedy or the sampled acceptance profile for a sequoia tree."""
  name = spec.partition("/")[0]
  unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Knobs)})
  if unknown:
    raise UsageError(f"unknown option(s) {', '.join(unknown)}; options: "
                     f"{', '.join(f.name for f in dataclasses.fields(Knobs))}")
  unread = sorted(set(options) - set(OPTIONS.get(name, set(options))))
  if unread:
    raise UsageError(f"{', '.join(unread)} does not apply to method {name!r} (it reads "
                     f"{', '.join(OPTIONS[name]) or 'none'})")
  return parse_method(spec, Knobs(**options), greedy)


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding configuration: `ar`, or a stack of levels below the target (`levels`, the
  --levels grammar that every speculative preset expands to), built once the draft is known."""
  name: str
  label: str = "ar"
  levels: spec_lib.Levels | None = None   # e.g. drafts/d.gguf@streaming:16x234/chain:1+retrieval:1024/6
  tree: object = None            # the bottom level's TokenTree / DynamicTree
  draft_path: str | None = None  # a separate draft model (loaded by `load_draft`)
  draft_mode: str = "deterministic"
  stack: object = None           # the stack.Stack, once built
  draft: object = None           # its DraftWeights once loaded
  heads: spec_lib.FeatureDraft | None = None   # a draft on the target's features (eagle:PATH, ...)
  step_aside: object = None      # a step_aside.StepAside: rows run plain rounds while drafts don't pay

  def build(self, target_config, draft_config=None, vocab=None):
    """The Stack for this target (and draft model config / vocabulary, if the stack has one)."""
    from hitree_jax import stacks
    return stacks.build(self.levels, target_config, draft_config, vocab, self.tree, self.step_aside)

  def check_draft(self, target_config, target_tokenizer):
    """Checks the stack and a separate draft against the target from metadata (no weights):
    vocabulary, tokenizer, tree and levels. Returns the draft's config, or None."""
    if self.heads is not None:
      from hitree_jax.heads import saved
      path = self.heads.path
      saved.check_target(saved.read_meta(path, self.heads.kind), target_config, path)
    if self.draft_path is None:
      self.build(target_config)
      return None
    from hitree_jax.loading import load_config, load_vocab
    from hitree_jax.tokenizer import load_tokenizer, same_tokenizer
    config, vocab = load_config(self.draft_path), load_vocab(self.draft_path)
    self.build(target_config, config, vocab)
    try:
      draft_tokenizer = load_tokenizer(self.draft_path)
    except FileNotFoundError as e:
      raise UsageError(f"--draft={self.draft_path}: cannot check that it shares the target's "
                       f"tokenizer ({e})") from None
    if not same_tokenizer(draft_tokenizer, target_tokenizer):
      raise UsageError(f"--draft={self.draft_path} has a different tokenizer from the target's: "
                       "a draft must tokenize text exactly as its target does")
    return config

  def load_draft(self, target_config, target_params=None):
    """Loads a separate draft model or a draft on the target's features (which reads
    target_params' head) -- slow: after every flag is validated -- and builds the stack."""
    from hitree_jax.decode.drafters import DraftWeights
    if self.heads is not None:
      from hitree_jax.heads import saved
      _, params, vocab = saved.load(self.heads.path, target_params, target_config, self.heads.kind)
      return dataclasses.replace(self, stack=self.build(target_config),
                                 draft=DraftWeights.create(params, vocab))
    if self.draft_path is None:
      return dataclasses.replace(self, stack=self.build(target_config))
    from hitree_jax.loading import load_model
    model = load_model(self.draft_path)
    return dataclasses.replace(self, stack=self.build(target_config, model.config, model.vocab),
                               draft=DraftWeights.create(model.params, model.vocab))

  def generate(self, params, config, prompts, **kwargs):
    """engine.generate with this stack; kwargs: max_new_tokens, sampling, seed, programs, ..."""
    from hitree_jax import stacks
    from hitree_jax.decode import engine
    stack = stacks.PLAIN if self.name == "ar" else self.stack
    if stack is None:
      raise UsageError(f"call load_draft() before generating with {self.label}")
    return engine.generate(params, config, prompts, stack=stack, draft=self.draft, **kwargs)


TREE_KINDS = ("chain", "kary", "sequoia", "dynamic")
HIERARCHY_DEFAULTS = {"triforce": dict(gamma1=1, gamma2=6), "hitree": dict(tree="kary:2x4", gamma2=12)}


def with_heads_kind(draft: str) -> str:
  """`draft`, or KIND:`draft` where it names a folder of trained heads (its heads.json says the
  kind) by path or shipped name: --draft=smollm2-eagle reads as eagle:smollm2-eagle."""
  level = spec_lib.parse_level(draft)
  kind = shipped.heads_kind(level.name) if level.kind == "draft" else None
  return draft if kind is None else str(spec_lib.Level.of(spec_lib.FeatureDraft(kind, level.name), level.cache,
                                                          level.mode))


def _split_draft_and_shape(rest: str) -> tuple[str, str | None]:
  """'DRAFT[/SHAPE]' where DRAFT may be a path with slashes: SHAPE is a number or a tree spec."""
  head, _, tail = rest.rpartition("/")
  if head and (tail.isdigit() or tail.partition(":")[0] in TREE_KINDS):
    return head, tail
  return rest, None


def acceptance_profile(acceptance: str | None, draft_path: str | None, greedy: bool) -> list[float]:
  """--acceptance (numbers or a JSON file), else the JSON that launch.distill wrote for the draft."""
  import json
  import pathlib
  from hitree_jax.train.export import check_sidecar, sidecar
  source = acceptance
  if source is None and draft_path is not None and sidecar(pathlib.Path(draft_path)).is_file():
    source = str(sidecar(pathlib.Path(draft_path)))
  if source is None:
    raise UsageError("sequoia trees need the draft's acceptance profile: pass --acceptance=P0,P1,... "
                     "or a JSON file from `python -m launch.distill --eval --json`")
  if source.endswith(".json"):
    record = json.loads(pathlib.Path(source).read_text())
    if acceptance is None:   # the draft's own sidecar: it must describe this draft
      record = check_sidecar(draft_path, record)
    return record["greedy_acceptance_profile" if greedy else "acceptance_profile"]
  try:
    return [float(x) for x in source.split(",")]
  except ValueError:
    raise UsageError(f"--acceptance={source}: expected comma-separated numbers or a .json file") from None


def join_method_specs(items: list[str]) -> list[str]:
  """Undoes a comma-separated flag's split inside a spec: every spec starts with a method name,
  so a piece that does not (the 4 of sequoia:8,4, the iid of self:4,iid) belongs to the one before."""
  specs = []
  for item in items:
    if specs and item.partition("/")[0] not in METHODS + ("auto",):
      specs[-1] += "," + item
    else:
      specs.append(item)
  return specs


def _levels_of(name: str, rest: str, knobs: Knobs) -> spec_lib.Levels:
  """Expands a preset (sd, tree, retrieval, triforce, hitree) into its levels."""
  draft, shape = _split_draft_and_shape(rest) if rest else (knobs.draft, None)
  if name == "retrieval":
    if rest and not rest.isdigit():
      raise UsageError(f"retrieval gamma {rest!r} must be an integer")
    # The retrieval level's law is close to the target's: sampling from it (iid) is accepted far
    # more often than its top token is (at T 0.6, 7.5K tokens: 0.98x ar against 0.68x).
    return spec_lib.Levels(spec_lib.Level.of(_retrieval(knobs), mode="iid"), _chain(rest or str(knobs.gamma)))
  bottom = spec_lib.parse_level(with_heads_kind(draft))
  if name == "sd":
    return spec_lib.Levels(bottom, _chain(shape or str(knobs.gamma)))
  if name == "tree":
    return spec_lib.Levels(bottom, spec_lib.parse_tree(shape or knobs.tree or "kary:2x2"))
  if not isinstance(bottom.source, spec_lib.DraftModel) or bottom.cache is not None:
    raise UsageError(f"--method={name} drafts with a draft model over a StreamingLLM cache (--sinks, "
                     f"--window): give --draft=PATH (e.g. drafts/smollm2-draft.gguf), not {draft}; "
                     "other stacks: --method=hsd --levels=...")
  from hitree_jax.cache.kinds import Streaming
  defaults = HIERARCHY_DEFAULTS[name]
  bottom = dataclasses.replace(bottom, cache=Streaming(knobs.sinks, knobs.window))
  tree = (spec_lib.Chain(knobs.gamma1 or defaults["gamma1"]) if name == "triforce"
          else spec_lib.parse_tree(shape or knobs.tree or defaults["tree"]))
  return spec_lib.Levels(bottom, tree, ((spec_lib.Level.of(_retrieval(knobs)), knobs.gamma2 or defaults["gamma2"]),))


def _chain(gamma: str) -> spec_lib.Chain:
  """A chain of `gamma` draft tokens, the tree of sd and retrieval."""
  from hitree_jax.tree.shapes import MAX_TREE_NODES
  if not gamma.lstrip("-").isdigit() or not 1 <= int(gamma) <= MAX_TREE_NODES:
    raise UsageError(f"gamma={gamma} must be an integer in [1, {MAX_TREE_NODES}] (draft tokens per round)")
  return spec_lib.Chain(int(gamma))


def _retrieval(knobs: Knobs):
  from hitree_jax.cache.kinds import Retrieval
  return Retrieval(knobs.budget, reselect=knobs.reselect)


def parse_method(spec: str, knobs: Knobs = Knobs(), greedy: bool = True) -> Method:
  """`ar`, `sd[/DRAFT[/GAMMA]]`, `tree[/DRAFT[/TREE]]`, `retrieval[/GAMMA]`, `triforce[/DRAFT]`,
  `hitree[/DRAFT[/TREE]]` or `hsd[/LEVELS]`; missing parts come from the flags (`knobs`). sd,
  tree and hsd take a last part `aside:BELOW[:ROUNDS[:MEMORY]]` (or knobs.step_aside): rows step aside while their drafts do not pay (decode/step_aside.py).

  e.g. sd/ngram/4, tree/self:8/kary:2x2, tree/self:4,without_replacement/chain:6,
  sd/drafts/smollm2-draft.gguf/3 (a draft model: any path the loaders read, [,mode]),
  hitree/drafts/smollm2-draft.gguf/kary:3x2, hsd/ngram:3/chain:2+draft/4+retrieval:1024/6.
  """
  name, _, rest = spec.partition("/")
  if name not in METHODS or (name == "ar" and rest):
    raise UsageError(f"method {spec!r} is not available; use ar, sd[/DRAFT[/GAMMA]], "
                     "tree[/DRAFT[/TREE]], retrieval[/GAMMA], triforce[/DRAFT], hitree[/DRAFT[/TREE]] "
                     "or hsd[/LEVELS]")
  if name == "ar":
    return Method("ar")
  knobs = dataclasses.replace(knobs, draft=with_heads_kind(knobs.draft))
  aside_text = knobs.step_aside
  head, _, last = rest.rpartition("/")
  if last.startswith("aside:"):   # the spec's last part
    rest, aside_text = head, last.removeprefix("aside:")
  step_aside = None
  if aside_text is not None:
    from hitree_jax.decode.step_aside import StepAside
    if name not in ("sd", "tree", "hsd"):
      raise UsageError(f"stepping aside (aside:{aside_text}) applies to sd, tree and hsd, not to {name}")
    step_aside = StepAside.parse(aside_text)
  if name == "hsd":
    if not (rest or knobs.levels):
      raise UsageError("--method=hsd needs its levels: --levels=DRAFTER/TREE+WHO/GAMMA+... "
                       "(e.g. ngram:3/chain:2+draft/4+retrieval:1024/6)")
    parsed = spec_lib.parse(rest or knobs.levels)
  else:
    parsed = _levels_of(name, rest, knobs)
  shape, mode = parsed.tree, parsed.drafter.mode
  model_named = [level.name for level in parsed.levels if level.kind == "draft"]
  heads = parsed.drafter.source if isinstance(parsed.drafter.source, spec_lib.FeatureDraft) else None
  if heads is not None:
    from hitree_jax.heads.saved import read_meta
    read_meta(heads.path, heads.kind)  # FileNotFoundError naming it, before any load
  for n in model_named:
    if n != "draft" and "/" not in n and "." not in n and not shipped.find(n).exists():  # a misspelt drafter
      raise UsageError(f"unknown drafter {n!r}: expected ngram[:N | :MIN-MAX], self:K, retrieval:BUDGET, "
                       "eagle:PATH, eagle3:PATH, medusa:PATH, dflash:PATH, or a draft model's path or shipped name")
  draft_path = None
  if model_named:
    paths = [n for n in model_named if n != "draft"]
    path = paths[0] if paths else spec_lib.parse_level(knobs.draft).name
    if len(set(paths)) > 1:
      raise UsageError(f"{str(parsed)!r} names two draft models ({', '.join(sorted(set(paths)))}); a "
                       "stack has one")
    if not isinstance(spec_lib.parse_level(path).source, spec_lib.DraftModel):
      raise UsageError(f"{str(parsed)!r} names a draft model: give its path (--draft=PATH)")
    from hitree_jax.loading import resolve
    draft_path = str(resolve(path))  # FileNotFoundError naming it, before any load
  acceptance = (acceptance_profile(knobs.acceptance, draft_path, greedy)
                if isinstance(parsed.tree, spec_lib.Sequoia) else None)
  token_tree = parsed.tree.topology(acceptance)
  label = _label(name, rest, knobs, shape, parsed) + (f"/aside:{step_aside}" if step_aside else "")
  return Method(name, label, parsed, token_tree, draft_path, mode, heads=heads, step_aside=step_aside)


# The drafts this repository ships, trained for SmolLM2-135M-Instruct (the `smollm2` model): on
# book text, and on chat answers (launch.distill's two recipes).
SHIPPED_DRAFTS = {"books": "smollm2-draft", "chat": "smollm2-draft-chat"}


def default_auto_draft(model: str, text: str = "austen") -> str:
  """--method=auto's draft model where none is given: the shipped draft trained for `model` on
  this kind of text (chat, or books). The planner weighs it beside the stacks that need no
  draft (prompt lookup, the target's own layers). Another model has none: an error says what
  to give."""
  from hitree_jax.loading import resolve, smollm2_gguf_path
  if resolve(model).resolve() != smollm2_gguf_path().resolve():
    raise UsageError(f"--method=auto plans stacks around a draft model, and none ships for "
                     f"--model={model}: give --draft=PATH (launch.distill trains one), or choose "
                     "a method that needs none (sd/ngram/8)")
  return str(shipped.find(SHIPPED_DRAFTS["chat" if text == "chat" else "books"]))


def check_auto_draft(draft: str, feature_draft: str | None = None) -> str | None:
  """Refuses what the planner cannot plan around; -> the EAGLE draft's folder, or None."""
  if spec_lib.parse_level(draft).kind != "draft":
    hint = (f" (an EAGLE draft joins with --feature_draft={draft})" if draft.startswith("eagle:") else "")
    raise UsageError(f"--method=auto plans stacks around a draft model: give --draft=PATH (e.g. "
                     f"drafts/smollm2-draft.gguf), not {draft}{hint}")
  if feature_draft is None:
    return None
  if not feature_draft.startswith("eagle:"):
    raise UsageError(f"--feature_draft={feature_draft}: the planner weighs an EAGLE draft, eagle:PATH "
                     "(Medusa's heads are not planned: each head's acceptance falls with its depth, "
                     "which its latency model does not describe)")
  from hitree_jax.heads.saved import read_meta
  path = feature_draft.removeprefix("eagle:")
  read_meta(path, "eagle")  # FileNotFoundError naming it, before any load
  return path


def auto_method(model: str, draft: str, prompt_length: int, sampling, loaded: tuple = (None, None),
                feature_draft: str | None = None, log=logging.getLogger(__name__).info,
                text: str = "austen", batch: int = 1) -> Method:
  """--method=auto: the stack the planner chooses (hitree_jax/planner/auto.py) around the draft
  model `draft` (and the EAGLE draft `feature_draft`, eagle:PATH), for this prompt length,
  sampling, kind of text (a book corpus, or "chat" for prompts in the chat template) and batch of
  `batch` rows, from the profile measured on first use."""
  from hitree_jax.planner import auto
  eagle = check_auto_draft(draft, feature_draft)
  precision = {} if loaded[0] is None else {"dtype": loaded[0].config.dtype, "key_dtype": loaded[0].config.key_dtype}
  choice, _, path = auto.plan_for(model, draft, prompt_length, sampling, text=text, loaded=loaded,
                                  log=lambda message: log("%s", message), eagle=eagle, batch=batch, **precision)
  log("--method=auto: %s, %.1f tok/s predicted (ar %.1f; profile %s)",
               f"hsd/{choice.levels}" if choice.levels else "ar", choice.predicted_tokens_per_s,
               choice.ar_tokens_per_s, path)
  if choice.levels is None:
    return Method("ar", label="auto=ar")
  flags = choice.flags(draft, eagle)
  method = parse_method("hsd", Knobs(draft=draft, levels=flags["levels"], acceptance=flags.get("acceptance"),
                                     step_aside=flags.get("step_aside")), float(sampling.temperature) == 0)
  return dataclasses.replace(method, label=f"auto={method.label}")


PAPER_SHAPES = {"triforce": "TriForce", "hitree": "HiTree"}   # presets whose defaults are a paper's
SLOW_PRESET = 0.9   # a preset predicted below this fraction of the planner's choice gets a note


def preset_advice(method: Method, model: str, prompt_length: int, sampling, dtype: str = "float32",
                  key_dtype: str | None = None, on_cpu: bool = False, text: str = "austen") -> str | None:
  """One line for a user who typed a preset this machine runs slowly, or None: a preset keeps its
  paper's shape (HiTree's kary:2x4 with gamma2 12 ran at about half `ar`'s speed on a 2-core CPU),
  so a user must be told when `auto` would do better. With a profile of (model, draft) already
  measured, the planner predicts both (nothing is measured here); without one, a paper's shape
  on a CPU is named as such."""
  if method.levels is None or method.draft_path is None:
    return None
  from hitree_jax.planner import auto
  greedy = float(sampling.temperature) == 0
  stored = auto.stored_plan(model, method.draft_path, prompt_length, sampling, text=text, dtype=dtype,
                            key_dtype=key_dtype)
  if stored is not None:
    profile, path = stored
    choice = auto.choose(profile, greedy)
    try:
      levels = auto.in_profile_names(method.levels, method.draft_path)
      tree = method.tree if isinstance(method.tree, TokenTree) else None
      speed = 1.0 / auto.predict(profile, greedy, levels, tree).seconds_per_token
    except UsageError:   # a level or tree the profile has no figures for
      speed = None
    if speed is not None:
      if speed >= SLOW_PRESET * choice.predicted_tokens_per_s:
        return None
      planned = f"hsd/{choice.levels}" if choice.levels else "ar"
      return (f"--method={method.label} is predicted at {speed:.1f} tok/s here and `ar` at "
              f"{choice.ar_tokens_per_s:.1f}; --method=auto would run {planned} at "
              f"{choice.predicted_tokens_per_s:.1f} (profile {path})")
  if on_cpu and method.name in PAPER_SHAPES:
    return (f"--method={method.name} keeps {PAPER_SHAPES[method.name]}'s shape from its paper, made "
            "for accelerators, and can run slower than `ar` on a CPU; --method=auto plans a stack "
            "for this machine (measuring it once, a few minutes)")
  return None


def _label(name: str, rest: str, knobs: Knobs, shape: spec_lib.TreeSpec, levels: spec_lib.Levels) -> str:
  """sd/DRAFT/GAMMA and tree/DRAFT/TREE, as typed; a hierarchy by its levels."""
  if name in ("sd", "tree"):
    draft = _split_draft_and_shape(rest)[0] if rest else knobs.draft
    return f"{name}/{draft}/{shape.length if name == 'sd' else shape}"
  return f"{name}/{levels}"
