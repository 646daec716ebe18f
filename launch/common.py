"""Flags and helpers shared by the launchers.

`run(main)` is every launcher's entry point: it restarts the process once
with glibc's malloc asking for huge pages (hitree_jax/huge_pages.py), parses
the flags, applies a `--config` file (ml_collections; see configs/), turns on
the persistent compilation cache, and turns a user's mistake (a ValueError,
FileNotFoundError or flag error) into one line on stderr and exit code 2
instead of a traceback. `HITREE_TRACEBACK=1` shows the traceback.
"""

from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from hitree_jax.decode import spec as spec_lib

METHODS = ("ar", "sd", "tree", "retrieval", "triforce", "hitree", "hsd")
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


# The speculation flags each method reads; any other one given is a mistake (it would be ignored).
METHOD_FLAGS = {
    "ar": (),
    "sd": ("draft", "gamma"),
    "tree": ("draft", "tree", "acceptance"),
    "retrieval": ("gamma", "budget", "reselect"),
    "triforce": ("draft", "budget", "reselect", "sinks", "window", "gamma1", "gamma2"),
    "hitree": ("draft", "tree", "acceptance", "budget", "reselect", "sinks", "window", "gamma2"),
    "hsd": ("draft", "levels", "acceptance"),
    "auto": ("draft", "feature_draft"),
}
SPECULATION_FLAGS = ("draft", "gamma", "tree", "acceptance", "budget", "reselect", "sinks", "window",
                     "gamma1", "gamma2", "levels", "feature_draft")


def check_method_flags(method_name: str, given: set[str]) -> None:
  """A flag that the chosen method would silently ignore is a mistake: say so."""
  if method_name not in METHOD_FLAGS:
    return  # parse_method names the unknown method
  for name in SPECULATION_FLAGS:
    if name in given and name not in METHOD_FLAGS[method_name]:
      users = [m for m, names in METHOD_FLAGS.items() if name in names]
      raise ValueError(f"--{name} does not apply to --method={method_name} "
                       f"(it sets --method={'|'.join(users)})")


def _quiet_orbax(record) -> bool:
  """Drops orbax's INFO lines (a record's levelno is Python's; absl's WARNING constant is -1)."""
  return record.levelno >= std_logging.WARNING or "orbax" not in record.pathname


def run(main, config_sets_flags: bool = True) -> None:
  """app.run(main) with --config applied (unless the launcher reads its config itself), the
  compilation cache on, and one-line usage errors. On Linux it first restarts the process once
  so that its weights and caches can sit in 2 MB pages (hitree_jax/huge_pages.py)."""
  from hitree_jax import huge_pages
  huge_pages.reexec_if_needed()

  def checked(argv):
    logging.get_absl_handler().addFilter(_quiet_orbax)  # it logs every save and load at INFO
    if len(argv) > 1:
      _fail(app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}"))
    try:
      if config_sets_flags:
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


def define_model_flags(key_dtype: bool = True):
  """--model and --dtype; --key_dtype where the launcher decodes with the model's caches."""
  flags.DEFINE_string("model", "smollm2", "smollm2, a .gguf file, an HF folder or a launch.convert checkpoint.")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter/activation dtype (default: "
                    "bfloat16 on a GPU or TPU, float32 on a CPU, where 16-bit products are slower).")
  if key_dtype:
    flags.DEFINE_enum("key_dtype", None, ["float32", "bfloat16"], "What the target's caches store keys "
                      "in (default: --dtype). bfloat16 halves the bytes attention over a long cache "
                      "reads, at the cost of the target's exact float32 numbers (like llama.cpp's "
                      "16-bit cache): every method stays exact against `ar` with the same setting.")


def model_dtype() -> str:
  """--dtype, or the default of the devices present: bfloat16 on an accelerator, float32 on a CPU
  (XLA:CPU has no fast 16-bit products)."""
  if flags.FLAGS.dtype is not None:
    return flags.FLAGS.dtype
  import jax
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def define_mesh_flags():
  flags.DEFINE_string("mesh", "", "Devices to shard over, AXIS:N[,AXIS:N...]: data (prompts), "
                      "sequence (the full caches' slots), model (the target's heads, MLP and "
                      "vocabulary), e.g. model:8 or data:2,model:4; empty: one device. On CPU, "
                      "XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices.")
  flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0. Every "
                      "process runs the same command with its own --process_id; --mesh spans the "
                      "devices of all of them.")
  flags.DEFINE_integer("num_processes", None, "Multi-host: how many processes.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0 .. num_processes-1.")


def mesh_from_flags(FLAGS):
  """Joins the other processes (multi-host: jax.distributed.initialize) and builds --mesh over the
  devices of all of them (None: one device). Call before anything else uses jax."""
  from hitree_jax import sharding
  axes = sharding.parse_mesh(FLAGS.mesh)
  multi = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if any(x is not None for x in multi):
    if any(x is None for x in multi):
      raise ValueError("multi-host needs all of --coordinator_address, --num_processes and --process_id")
    if not 0 <= FLAGS.process_id < FLAGS.num_processes:
      raise ValueError(f"--process_id={FLAGS.process_id} must be in [0, --num_processes="
                       f"{FLAGS.num_processes})")
    if not axes:
      raise ValueError("multi-host needs a --mesh over the processes' devices (e.g. --mesh=model:2)")
    import jax
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  return sharding.make_mesh(axes)


def define_sampling_flags():
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1 = off.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
  flags.DEFINE_integer("seed", 0, "PRNG seed: a run is reproducible from it.")


def define_speculation_flags():
  flags.DEFINE_string("draft", "self:8", "Drafter: self:K[,iid|without_replacement|deterministic] "
                      "(the target's first K layers), ngram[:N] (prompt lookup), eagle:PATH[,mode] "
                      "or medusa:PATH[,mode] (drafts on the target's features, e.g. "
                      "eagle:drafts/smollm2-eagle), or PATH[,mode]: a separate draft model (e.g. "
                      "drafts/smollm2-draft.gguf).")
  flags.DEFINE_integer("gamma", 4, "Draft tokens per round for --method=sd and --method=retrieval.")
  flags.DEFINE_string("tree", None, "Tree for --method=tree (default kary:2x2) and --method=hitree "
                      "(default kary:2x4, HiTree's binary tree of depth 4): chain:N, kary:KxD, "
                      "sequoia:BUDGET,DEPTH (the best tree for --acceptance) or dynamic:BUDGET,DEPTH "
                      "(EAGLE-2: the BUDGET most probable of the draft's candidates, chosen each round).")
  flags.DEFINE_string("acceptance", None, "Sequoia trees: the draft's per-rank acceptance "
                      "probabilities, comma-separated, or a JSON file holding 'acceptance_profile' "
                      "(launch.distill writes DRAFT.json next to each draft: the default for a draft "
                      "model).")
  flags.DEFINE_integer("budget", 1024, "Retrieval cache slots (chunks of 8, the sink chunk kept) of "
                       "the target's retrieval level: --method=retrieval, triforce, hitree.")
  flags.DEFINE_integer("reselect", 0, "The retrieval level chooses its chunks again, with the "
                       "newest token's query, every this many committed tokens (at the end of a "
                       "block; 0: once, after prefill, as TriForce does).")
  flags.DEFINE_integer("sinks", 16, "StreamingLLM cache of the bottom draft (triforce, hitree): "
                       "attention-sink tokens kept (TriForce: 16).")
  flags.DEFINE_integer("window", 234, "StreamingLLM cache of the bottom draft: most recent tokens "
                       "kept (TriForce: 234).")
  flags.DEFINE_integer("gamma1", None, "Draft tokens per round from the bottom draft to the "
                       "retrieval level, --method=triforce (default 1, TriForce's).")
  flags.DEFINE_integer("gamma2", None, "Tokens the retrieval level buffers before the target "
                       "verifies them: --method=triforce (default 6) and hitree (default 12).")
  define_feature_draft_flag()
  flags.DEFINE_string("levels", None, "--method=hsd: the stack below the target, bottom-up, levels "
                      "joined by '+': DRAFTER/TREE first (DRAFTER: ngram[:N], self:K, draft (the "
                      "--draft model) or PATH, [@streaming:SINKSxWINDOW], [,MODE]; or retrieval:BUDGET), "
                      "then WHO/GAMMA per level (WHO: retrieval:BUDGET[:RESELECT] or draft[@streaming:SxW]). "
                      "e.g. ngram:3/chain:2+draft/4+retrieval:1024/6 (docs/methods.md).")


def define_feature_draft_flag():
  flags.DEFINE_string("feature_draft", None, "--method=auto (and launch.plan): an EAGLE draft, "
                      "eagle:PATH (e.g. eagle:drafts/smollm2-eagle), that the planner also weighs as the "
                      "bottom level, under the target or a retrieval level.")


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

  @classmethod
  def from_flags(cls, FLAGS) -> "Knobs":
    return cls(**{f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(cls)})


def sampling_from_flags(FLAGS):
  from hitree_jax.decode.sampling import SamplingParams
  return SamplingParams.create(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k)


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding configuration: `ar`, or a stack of levels below the target (`levels`, the
  --levels grammar that every speculative preset expands to), built once the draft is known."""
  name: str
  label: str = "ar"
  levels: str | None = None      # e.g. drafts/d.gguf@streaming:16x234/chain:1+retrieval:1024/6
  tree: object = None            # the bottom level's TokenTree / DynamicTree
  draft_path: str | None = None  # a separate draft model (loaded by `load_draft`)
  draft_mode: str = "deterministic"
  stack: object = None           # the stack.Stack, once built
  draft: object = None           # its DraftWeights once loaded
  heads: str | None = None       # a draft on the target's features: eagle:PATH or medusa:PATH

  def build(self, target_config, draft_config=None, vocab=None):
    """The Stack for this target (and draft model config / vocabulary, if the stack has one)."""
    from hitree_jax.decode.stack import Stack
    if self.levels is None:
      return Stack()
    levels = spec_lib.parse(self.levels)
    drafter = _drafter(levels.drafter, target_config, draft_config, vocab)
    verifiers = tuple(_verifier(level, gamma) for level, gamma in levels.middles)
    stack = Stack(drafter, self.tree, verifiers, draft=draft_config)
    from hitree_jax.decode.engine import check_stack
    check_stack(stack, target_config)
    return stack

  def check_draft(self, target_config, target_tokenizer):
    """Checks the stack and a separate draft against the target from metadata (no weights):
    vocabulary, tokenizer, tree and levels. Returns the draft's config, or None."""
    if self.heads is not None:
      from hitree_jax.train import heads
      kind, path = spec_lib.parse_level(self.heads).feature_draft
      heads.check_target(heads.read_meta(path, kind), target_config, path)
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
      raise ValueError(f"--draft={self.draft_path}: cannot check that it shares the target's "
                       f"tokenizer ({e})") from None
    if not same_tokenizer(draft_tokenizer, target_tokenizer):
      raise ValueError(f"--draft={self.draft_path} has a different tokenizer from the target's: "
                       "a draft must tokenize text exactly as its target does")
    return config

  def load_draft(self, target_config, target_params=None):
    """Loads a separate draft model or a draft on the target's features (which reads
    target_params' head) -- slow: after every flag is validated -- and builds the stack."""
    from hitree_jax.decode.drafters import DraftWeights
    if self.heads is not None:
      from hitree_jax.train import heads
      kind, path = spec_lib.parse_level(self.heads).feature_draft
      _, params, vocab = heads.load(path, target_params, target_config, kind)
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
    from hitree_jax.decode import engine
    from hitree_jax.decode.stack import Stack
    stack = Stack() if self.name == "ar" else self.stack
    if stack is None:
      raise ValueError(f"call load_draft() before generating with {self.label}")
    return engine.generate(params, config, prompts, stack=stack, draft=self.draft, **kwargs)


DRAW_MODES = spec_lib.DRAW_MODES
TREE_KINDS = ("chain", "kary", "sequoia", "dynamic")
HIERARCHY_DEFAULTS = {"triforce": dict(gamma1=1, gamma2=6), "hitree": dict(tree="kary:2x4", gamma2=12)}


def _drafter(level: spec_lib.Level, target_config, draft_config, vocab):
  """The bottom level of a stack: ngram[:N], self:K, retrieval:B, eagle:PATH, medusa:PATH, or
  a draft model (`draft`, the --draft model, or its path) over its cache."""
  from hitree_jax.decode.drafters import ModelDrafter, parse_draft_spec
  from hitree_jax.decode.stack import Full
  if level.feature_draft is not None:
    from hitree_jax.train import heads
    kind, path = level.feature_draft
    return heads.drafter(heads.read_meta(path, kind), target_config, level.mode)
  if level.kind == "retrieval":
    return ModelDrafter(target_config, level.mode, cache=level.retrieval, weights="target")
  if level.kind in ("ngram", "self"):
    return parse_draft_spec(level.name if level.mode == "deterministic" else f"{level.name},{level.mode}")
  if draft_config is None:
    raise ValueError(f"level {str(level)!r} names a draft model: give its path (--draft=PATH)")
  return ModelDrafter(draft_config, level.mode, vocab and vocab.target_vocab_size, cache=level.cache or Full())


def _verifier(level: spec_lib.Level, gamma: int):
  """A middle level: the target over a retrieval cache, or the draft model over its cache."""
  from hitree_jax.decode.stack import Full, Verifier
  if level.kind == "retrieval":
    return Verifier("target", level.retrieval, gamma)
  return Verifier("draft", level.cache or Full(), gamma)


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
    if specs and item.partition("/")[0] not in METHODS + ("auto",):
      specs[-1] += "," + item
    else:
      specs.append(item)
  return specs


def _levels_of(name: str, rest: str, knobs: Knobs) -> str:
  """Expands a preset (sd, tree, retrieval, triforce, hitree) into its --levels spec."""
  draft, shape = _split_draft_and_shape(rest) if rest else (knobs.draft, None)
  if name in ("sd", "tree", "retrieval"):
    if name == "tree":
      return f"{draft}/{shape or knobs.tree or 'kary:2x2'}"
    if name == "retrieval":
      draft, shape = "", rest or None
      if shape is not None and not shape.isdigit():
        raise ValueError(f"retrieval gamma {shape!r} must be an integer")
    n = shape or str(knobs.gamma)
    from hitree_jax.tree.shapes import MAX_TREE_NODES
    if not n.lstrip("-").isdigit() or not 1 <= int(n) <= MAX_TREE_NODES:
      raise ValueError(f"gamma={n} must be an integer in [1, {MAX_TREE_NODES}] (draft tokens per round)")
    # The retrieval level's law is close to the target's: sampling from it (iid) is accepted far
    # more often than its top token is (at T 0.6, 7.5K tokens: 0.98x ar against 0.68x).
    who = f"{_retrieval_name(knobs)},iid" if name == "retrieval" else draft
    return f"{who}/chain:{n}"
  defaults = HIERARCHY_DEFAULTS[name]
  if spec_lib.parse_level(draft).kind in ("ngram", "self"):
    raise ValueError(f"--method={name} drafts with a draft model over a StreamingLLM cache: give "
                     f"--draft=PATH (e.g. drafts/smollm2-draft.gguf), not {draft}; other stacks: "
                     "--method=hsd --levels=...")
  streaming = f"@streaming:{knobs.sinks}x{knobs.window}"
  who, _, mode = draft.rpartition(",") if draft.rpartition(",")[2] in DRAW_MODES else (draft, "", "")
  bottom = f"{who}{streaming}{',' + mode if mode else ''}"
  if name == "triforce":
    tree = f"chain:{knobs.gamma1 or defaults['gamma1']}"
  else:
    tree = shape or knobs.tree or defaults["tree"]
  return f"{bottom}/{tree}+{_retrieval_name(knobs)}/{knobs.gamma2 or defaults['gamma2']}"


def _retrieval_name(knobs: Knobs) -> str:
  return f"retrieval:{knobs.budget}" + (f":{knobs.reselect}" if knobs.reselect else "")


def parse_method(spec: str, knobs: Knobs = Knobs(), greedy: bool = True) -> Method:
  """`ar`, `sd[/DRAFT[/GAMMA]]`, `tree[/DRAFT[/TREE]]`, `retrieval[/GAMMA]`, `triforce[/DRAFT]`,
  `hitree[/DRAFT[/TREE]]` or `hsd[/LEVELS]`; missing parts come from the flags (`knobs`).

  e.g. sd/ngram/4, tree/self:8/kary:2x2, tree/self:4,without_replacement/chain:6,
  sd/drafts/smollm2-draft.gguf/3 (a draft model: any path the loaders read, [,mode]),
  hitree/drafts/smollm2-draft.gguf/kary:3x2, hsd/ngram:3/chain:2+draft/4+retrieval:1024/6.
  """
  from hitree_jax.tree import shapes as tree_lib
  name, _, rest = spec.partition("/")
  if name not in METHODS or (name == "ar" and rest):
    raise ValueError(f"method {spec!r} is not available; use ar, sd[/DRAFT[/GAMMA]], "
                     "tree[/DRAFT[/TREE]], retrieval[/GAMMA], triforce[/DRAFT], hitree[/DRAFT[/TREE]] "
                     "or hsd[/LEVELS]")
  if name == "ar":
    return Method("ar")
  if name == "hsd":
    levels = rest or knobs.levels
    if not levels:
      raise ValueError("--method=hsd needs its levels: --levels=DRAFTER/TREE+WHO/GAMMA+... "
                       "(e.g. ngram:3/chain:2+draft/4+retrieval:1024/6)")
  else:
    levels = _levels_of(name, rest, knobs)
  parsed = spec_lib.parse(levels)
  shape, mode = parsed.tree, parsed.drafter.mode
  model_named = [level.name for level in parsed.levels if level.kind == "draft"]
  heads = parsed.drafter.name if parsed.drafter.feature_draft is not None else None
  if heads is not None:
    from hitree_jax.train.heads import read_meta
    kind, path = parsed.drafter.feature_draft
    read_meta(path, kind)  # FileNotFoundError naming it, before any load
  for n in model_named:
    if n != "draft" and "/" not in n and "." not in n:  # not a path: a misspelt drafter
      from hitree_jax.decode.drafters import parse_draft_spec
      parse_draft_spec(n)  # raises, naming it
  draft_path = None
  if model_named:
    paths = [n for n in model_named if n != "draft"]
    path = paths[0] if paths else spec_lib.parse_level(knobs.draft).name
    if len(set(paths)) > 1:
      raise ValueError(f"{levels!r} names two draft models ({', '.join(sorted(set(paths)))}); a "
                       "stack has one")
    if path.startswith(("ngram", "self:")):
      raise ValueError(f"{levels!r} names a draft model: give its path (--draft=PATH)")
    from hitree_jax.loading import resolve
    draft_path = str(resolve(path))  # FileNotFoundError naming it, before any load
  token_tree = tree_lib.parse_tree_spec(f"chain:{shape}" if shape.isdigit() else shape)
  if isinstance(token_tree, tuple):  # ("sequoia", budget, depth)
    profile = acceptance_profile(knobs.acceptance, draft_path, greedy)
    token_tree = tree_lib.from_acceptance(profile, *token_tree[1:])
  return Method(name, _label(name, rest, knobs, shape, levels), levels, token_tree, draft_path, mode,
                heads=heads)


def check_auto_draft(draft: str, feature_draft: str | None = None) -> str | None:
  """Refuses what the planner cannot plan around; -> the EAGLE draft's folder, or None."""
  if spec_lib.parse_level(draft).kind != "draft":
    hint = (f" (an EAGLE draft joins with --feature_draft={draft})" if draft.startswith("eagle:") else "")
    raise ValueError(f"--method=auto plans stacks around a draft model: give --draft=PATH (e.g. "
                     f"drafts/smollm2-draft.gguf), not {draft}{hint}")
  if feature_draft is None:
    return None
  if not feature_draft.startswith("eagle:"):
    raise ValueError(f"--feature_draft={feature_draft}: the planner weighs an EAGLE draft, eagle:PATH "
                     "(Medusa's heads are not planned: each head's acceptance falls with its depth, "
                     "which its latency model does not describe)")
  from hitree_jax.train.heads import read_meta
  path = feature_draft.removeprefix("eagle:")
  read_meta(path, "eagle")  # FileNotFoundError naming it, before any load
  return path


def auto_method(model: str, draft: str, prompt_length: int, sampling, loaded: tuple = (None, None),
                feature_draft: str | None = None) -> Method:
  """--method=auto: the stack the planner chooses (hitree_jax/planner/auto.py) around the draft
  model `draft` (and the EAGLE draft `feature_draft`, eagle:PATH), for this prompt length and
  sampling, from the profile measured on first use."""
  from hitree_jax.planner import auto
  eagle = check_auto_draft(draft, feature_draft)
  precision = {} if loaded[0] is None else {"dtype": loaded[0].config.dtype, "key_dtype": loaded[0].config.key_dtype}
  choice, _, path = auto.plan_for(model, draft, prompt_length, sampling, loaded=loaded,
                                  log=lambda message: logging.info("%s", message), eagle=eagle, **precision)
  logging.info("--method=auto: %s, %.1f tok/s predicted (ar %.1f; profile %s)",
               f"hsd/{choice.levels}" if choice.levels else "ar", choice.predicted_tokens_per_s,
               choice.ar_tokens_per_s, path)
  if choice.levels is None:
    return Method("ar", label="auto=ar")
  flags = choice.flags(draft, eagle)
  method = parse_method("hsd", Knobs(draft=draft, levels=flags["levels"], acceptance=flags.get("acceptance")),
                        float(sampling.temperature) == 0)
  return dataclasses.replace(method, label=f"auto={method.label}")


def _label(name: str, rest: str, knobs: Knobs, shape: str, levels: str) -> str:
  """sd/DRAFT/GAMMA and tree/DRAFT/TREE as before; a hierarchy by its levels."""
  if name in ("sd", "tree"):
    draft = _split_draft_and_shape(rest)[0] if rest else knobs.draft
    return f"{name}/{draft}/{shape.removeprefix('chain:') if name == 'sd' else shape}"
  return f"{name}/{levels}"
