"""Flags and helpers shared by the launchers."""

from __future__ import annotations

import dataclasses

from absl import flags

METHODS = ("ar", "sd", "tree")


def define_model_flags():
  flags.DEFINE_string("model", "smollm2", "smollm2, a .gguf file, an HF folder or a launch.convert checkpoint.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype (float32 on CPU).")


def define_sampling_flags():
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1 = off.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
  flags.DEFINE_integer("seed", 0, "PRNG seed: a run is reproducible from it.")


def define_speculation_flags():
  flags.DEFINE_string("draft", "self:8", "Drafter: self:K[,iid|without_replacement|deterministic] "
                      "(the target's first K layers), ngram[:N] (prompt lookup), or PATH[,mode]: "
                      "a separate draft model (e.g. drafts/smollm2-draft.gguf).")
  flags.DEFINE_integer("gamma", 4, "Draft tokens per round for --method=sd.")
  flags.DEFINE_string("tree", "kary:2x2", "Tree for --method=tree: chain:N, kary:KxD, "
                      "sequoia:BUDGET,DEPTH (the best tree for --acceptance) or dynamic:BUDGET,DEPTH "
                      "(EAGLE-2: the BUDGET most probable of the draft's candidates, chosen each round).")
  flags.DEFINE_string("acceptance", None, "Sequoia trees: the draft's per-rank acceptance "
                      "probabilities, comma-separated, or a JSON file holding 'acceptance_profile' "
                      "(launch.distill writes DRAFT.json next to each draft: the default for a draft "
                      "model).")


def sampling_from_flags(FLAGS):
  from hitree_jax.sampling import SamplingParams
  return SamplingParams.create(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k)


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding configuration: `ar`, or `sd` / `tree` with a drafter and a tree."""
  name: str
  drafter: object = None
  tree: object = None
  label: str = "ar"
  draft_path: str | None = None  # a separate draft model, loaded by `load_draft`
  draft_mode: str = "deterministic"
  draft: object = None           # its DraftWeights once loaded

  def load_draft(self, target_config):
    """Loads a separate draft model (slow: after every flag is validated); others pass through."""
    if self.draft_path is None:
      return self
    from hitree_jax.drafters import DraftWeights, ModelDrafter
    from hitree_jax.loading import load_model
    model = load_model(self.draft_path)
    vocab = model.vocab
    drafter = ModelDrafter(model.config, self.draft_mode,
                           vocab.target_vocab_size if vocab is not None else None)
    drafter.check(self.tree, target_config)
    return dataclasses.replace(self, drafter=drafter, draft=DraftWeights.create(model.params, vocab))

  def generate(self, params, config, prompts, **kwargs):
    from hitree_jax import decoding, engine
    if self.name == "ar":
      return decoding.generate(params, config, prompts, **kwargs)
    if self.draft_path is not None and self.draft is None:
      raise ValueError(f"call load_draft() before generating with {self.draft_path}")
    return engine.generate(params, config, prompts, tree=self.tree, drafter=self.drafter,
                           draft=self.draft, **kwargs)


DRAW_MODES = ("deterministic", "iid", "without_replacement")


def _split_draft_and_shape(rest: str) -> tuple[str, str | None]:
  """'DRAFT[/SHAPE]' where DRAFT may be a path with slashes: SHAPE is a number or a tree spec."""
  head, _, tail = rest.rpartition("/")
  if head and (tail.isdigit() or tail.partition(":")[0] in ("chain", "kary", "sequoia", "dynamic")):
    return head, tail
  return rest, None


def acceptance_profile(acceptance: str | None, draft_path: str | None, greedy: bool) -> list[float]:
  """--acceptance (numbers or a JSON file), else the JSON that launch.distill wrote for the draft."""
  import json
  import pathlib
  source = acceptance
  if source is None and draft_path is not None and pathlib.Path(draft_path).with_suffix(".json").is_file():
    source = str(pathlib.Path(draft_path).with_suffix(".json"))
  if source is None:
    raise ValueError("sequoia trees need the draft's acceptance profile: pass --acceptance=P0,P1,... "
                     "or a JSON file from `python -m launch.distill --eval --json`")
  if source.endswith(".json"):
    record = json.loads(pathlib.Path(source).read_text())
    return record["greedy_acceptance_profile" if greedy else "acceptance_profile"]
  try:
    return [float(x) for x in source.split(",")]
  except ValueError:
    raise ValueError(f"--acceptance={source}: expected comma-separated numbers or a .json file") from None


def join_method_specs(items: list[str]) -> list[str]:
  """Undoes a comma-separated flag's split inside a spec: every spec starts with a method name,
  so a piece that does not (the 4 of sequoia:8,4, the iid of self:4,iid) belongs to the one before."""
  specs = []
  for item in items:
    if specs and item.partition("/")[0] not in METHODS:
      specs[-1] += "," + item
    else:
      specs.append(item)
  return specs


def parse_method(spec: str, draft: str, gamma: int, tree: str, acceptance: str | None = None,
                 greedy: bool = True) -> Method:
  """`ar`, `sd[/DRAFT[/GAMMA]]` or `tree[/DRAFT[/TREE]]`; missing parts come from the flags.

  e.g. sd/ngram/4, tree/self:8/kary:2x2, tree/self:4,without_replacement/chain:6,
  sd/drafts/smollm2-draft.gguf/3 (a draft model: any path the loaders read, [,mode]).
  """
  from hitree_jax import tree as tree_lib
  from hitree_jax.drafters import parse_draft_spec
  name, _, rest = spec.partition("/")
  if name not in METHODS or (name == "ar" and rest):
    raise ValueError(f"method {spec!r} is not available; use ar, sd[/DRAFT[/GAMMA]] or "
                     f"tree[/DRAFT[/TREE]] with methods {METHODS}")
  if name == "ar":
    return Method("ar")
  draft, shape = _split_draft_and_shape(rest) if rest else (draft, None)
  draft_path, mode = None, "deterministic"
  looks_like_path = "/" in draft or "." in draft.partition(",")[0]
  if not looks_like_path:
    drafter = parse_draft_spec(draft)
  else:
    path, _, mode = draft.rpartition(",") if draft.rpartition(",")[2] in DRAW_MODES else (draft, "", "")
    mode = mode or "deterministic"
    from hitree_jax.loading import resolve
    draft_path, drafter = str(resolve(path)), None  # FileNotFoundError naming it, before any load
  if name == "sd":
    try:
      n = int(shape) if shape else gamma
    except ValueError:
      raise ValueError(f"sd gamma {shape!r} must be an integer") from None
    if n < 1:
      raise ValueError(f"gamma={n} must be >= 1")
    token_tree, shape = tree_lib.chain(n), str(n)
  else:
    shape = shape or tree
    token_tree = tree_lib.parse_tree_spec(shape)
    if isinstance(token_tree, tuple):  # ("sequoia", budget, depth)
      profile = acceptance_profile(acceptance, draft_path, greedy)
      token_tree = tree_lib.from_acceptance(profile, *token_tree[1:])
  return Method(name, drafter, token_tree, f"{name}/{draft}/{shape}", draft_path, mode)
