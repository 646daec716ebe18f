"""Flags and helpers shared by the launchers.

`run(main)` is every launcher's entry point: it parses the flags, applies a
`--config` file (ml_collections; see configs/), turns on the persistent
compilation cache, and turns a user's mistake (a ValueError,
FileNotFoundError or flag error) into one line on stderr and exit code 2
instead of a traceback. `HITREE_TRACEBACK=1` shows the traceback.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags
from ml_collections import config_flags

METHODS = ("ar", "sd", "tree")
USAGE_ERROR = 2  # exit code of a user's mistake (as argparse uses)


def define_config_flag():
  config_flags.DEFINE_config_file(
      "config", None, "An ml_collections config file (configs/*.py[:PRESET]) whose fields set this "
      "launcher's flags of the same names; flags given on the command line win, and "
      "--config.NAME=VALUE overrides one field.", lock_config=True)


def _fail(error) -> None:
  """One line on stderr and exit code 2 (a config file's error arrives with its traceback:
  keep its first line and its last, the exception itself)."""
  if os.environ.get("HITREE_TRACEBACK"):
    raise error
  lines = [line for line in str(error).strip().splitlines() if line.strip()] or [repr(error)]
  message = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(e)
  except (AttributeError, KeyError) as e:  # --config.NAME=... for a field the config lacks
    _fail(ValueError(f"a --config.NAME override names a field the config does not have: {e}"))


def apply_config() -> None:
  """Sets every flag named in --config (that the command line did not set) to the config's value."""
  FLAGS = flags.FLAGS
  config = FLAGS["config"].value if "config" in FLAGS else None
  if config is None:
    return
  for name, value in config.items():
    if name not in FLAGS:
      raise ValueError(f"the config sets {name!r}, which this launcher has no flag for")
    FLAGS.set_default(name, value)  # validated by the flag's parser; an explicit flag keeps its value


def given_flags() -> set[str]:
  """Names of the flags set on the command line (a --config only sets defaults: a pair of
  model and draft serves every method, `ar` included)."""
  FLAGS = flags.FLAGS
  return {name for name in FLAGS if FLAGS[name].present}


def launcher_settings() -> dict:
  """The launcher's own flag values (not absl's or jax's): the JSON record's settings."""
  FLAGS = flags.FLAGS
  by_module = FLAGS.flags_by_module_dict()
  return {f.name: f.value for module, fs in by_module.items() if "launch" in module
          for f in fs if f.name != "config"}


def check_method_flags(method_name: str, given: set[str]) -> None:
  """A flag that the chosen method would silently ignore is a mistake: say so."""
  ignored = {"ar": ("draft", "gamma", "tree", "acceptance"), "sd": ("tree", "acceptance"),
             "tree": ("gamma",)}.get(method_name, ())
  for name in ignored:
    if name in given:
      hint = {"tree": "a tree needs --method=tree", "gamma": "--gamma sets the chain of --method=sd",
              "acceptance": "--acceptance shapes a sequoia tree (--method=tree)",
              "draft": "--method=ar uses no draft"}[name]
      raise ValueError(f"--{name} does not apply to --method={method_name} ({hint})")


def run(main) -> None:
  """app.run(main) with --config applied, the compilation cache on, and one-line usage errors."""

  def checked(argv):
    if len(argv) > 1:
      _fail(app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}"))
    try:
      apply_config()
    except OSError as e:  # a --config file that does not exist or does not load
      _fail(e)
    try:
      from hitree_jax import compile_cache
      compile_cache.enable()
      return main(argv)
    except (ValueError, FileNotFoundError, app.UsageError, flags.Error) as e:
      _fail(e)

  app.run(checked, flags_parser=_parse_flags)


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

  def check_draft(self, target_config, target_tokenizer):
    """Checks a separate draft against the target from metadata (no weights): its vocabulary,
    tokenizer and tree settings. Returns the draft's config, or None for other drafters."""
    if self.draft_path is None:
      return None
    from hitree_jax.drafters import ModelDrafter
    from hitree_jax.loading import load_config, load_vocab
    from hitree_jax.tokenizer import load_tokenizer, same_tokenizer
    config, vocab = load_config(self.draft_path), load_vocab(self.draft_path)
    ModelDrafter(config, self.draft_mode, vocab and vocab.target_vocab_size).check(self.tree, target_config)
    try:
      draft_tokenizer = load_tokenizer(self.draft_path)
    except FileNotFoundError as e:
      raise ValueError(f"--draft={self.draft_path}: cannot check that it shares the target's "
                       f"tokenizer ({e})") from None
    if not same_tokenizer(draft_tokenizer, target_tokenizer):
      raise ValueError(f"--draft={self.draft_path} has a different tokenizer from the target's: "
                       "a draft must tokenize text exactly as its target does")
    return config

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
    if not 1 <= n <= tree_lib.MAX_TREE_NODES:
      raise ValueError(f"gamma={n} must be in [1, {tree_lib.MAX_TREE_NODES}] (draft tokens per round)")
    token_tree, shape = tree_lib.chain(n), str(n)
  else:
    shape = shape or tree
    token_tree = tree_lib.parse_tree_spec(shape)
    if isinstance(token_tree, tuple):  # ("sequoia", budget, depth)
      profile = acceptance_profile(acceptance, draft_path, greedy)
      token_tree = tree_lib.from_acceptance(profile, *token_tree[1:])
  return Method(name, drafter, token_tree, f"{name}/{draft}/{shape}", draft_path, mode)
