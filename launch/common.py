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
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from hitree_jax import errors, methods, shipped
from hitree_jax.errors import NotFound, UsageError

USAGE_ERROR = 2  # exit code of a user's mistake (as argparse uses)


def define_config_flag():
  config_flags.DEFINE_config_file(
      "config", None, "An ml_collections config file (configs/*.py[:PRESET]) whose fields set this "
      "launcher's flags of the same names; flags given on the command line win, and "
      "--config.NAME=VALUE overrides one field.", lock_config=True)


def _fail(error) -> None:
  """One line on stderr and exit code 2 (a config file's error arrives with its traceback:
  keep its first line and its last, the exception itself)."""
  if errors.env_switch("HITREE_TRACEBACK", default=False):
    raise error
  lines = [line for line in str(error).strip().splitlines() if line.strip()] or [repr(error)]
  message = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


# Flags that were renamed, and what to give instead (one name per thing in every launcher).
RENAMED_FLAGS = {"book": "--text=BOOK", "chat": "--text=chat", "nochat": "no --text (plain text)",
                 "prompts": "--text=chat (Spec-Bench's questions; --questions=FILE for your own)",
                 "train_text": "--text", "reuse_overheads": "--full_profile (a full measurement)",
                 "noreuse_overheads": "--full_profile (a full measurement)"}


def _renamed(arg: str) -> None:
  """Fails on a flag of RENAMED_FLAGS, naming what replaced it (absl would only call it unknown)."""
  name = arg.removeprefix("--").partition("=")[0]
  if arg.startswith("--") and name in RENAMED_FLAGS and name not in flags.FLAGS:
    _fail(UsageError(f"--{name} is now {RENAMED_FLAGS[name]}"))


def _parse_flags(argv):
  argv = [_shipped_config(arg) for arg in argv]
  for arg in argv[1:]:
    _renamed(arg)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(e)
  except (AttributeError, KeyError) as e:  # --config.NAME=... for a field the config lacks
    _fail(ValueError(f"a --config.NAME override names a field the config does not have: {e}"))


def _shipped_config(arg: str) -> str:
  """--config=PATH[:PRESET] with PATH found from any directory: as given, else among the
  repository's configs/ (configs/methods.py, methods.py or methods all name the shipped one)."""
  if not arg.startswith("--config="):
    return arg
  given, colon, preset = arg.removeprefix("--config=").partition(":")
  path = shipped.find(given, "configs", ("", ".py"))
  if not path.is_file():
    _fail(NotFound(f"--config={given}: no such file (a configs/*.py file, or a shipped config's "
                   f"name: {', '.join(shipped.names('configs', '.py'))})"))
  return f"--config={path}{colon}{preset}"


def _load_config() -> None:
  """Loads --config now: ml_collections loads it when first read, so a launcher reading it late
  would meet its error (a typo in the file, a missing preset) under a traceback of its own."""
  if "config" in flags.FLAGS and flags.FLAGS["config"].present:
    try:
      flags.FLAGS["config"].value  # noqa: B018 (loads the file)
    except (OSError, AttributeError, KeyError, SyntaxError, ValueError) as e:
      _fail(UsageError(f"--config: {str(e).strip() or repr(e)}"))


def apply_config() -> None:
  """Sets every flag named in --config (that the command line did not set) to the config's value."""
  FLAGS = flags.FLAGS
  config = FLAGS["config"].value if "config" in FLAGS else None
  if config is None:
    return
  for name, value in config.items():
    if name not in FLAGS:
      raise UsageError(f"the config sets {name!r}, which this launcher has no flag for")
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


SPECULATION_FLAGS = tuple(dict.fromkeys(name for names in methods.OPTIONS.values() for name in names))


def check_method_flags(method_name: str, given: set[str]) -> None:
  """A flag that the chosen method would silently ignore is a mistake: say so."""
  if method_name not in methods.OPTIONS:
    return  # parse_method names the unknown method
  for name in SPECULATION_FLAGS:
    if name in given and name not in methods.OPTIONS[method_name]:
      users = [m for m, names in methods.OPTIONS.items() if name in names]
      raise UsageError(f"--{name} does not apply to --method={method_name} "
                       f"(it sets --method={'|'.join(users)})")


def _quiet_orbax(record) -> bool:
  """Drops orbax's INFO lines (a record's levelno is Python's; absl's WARNING constant is -1)."""
  return record.levelno >= std_logging.WARNING or "orbax" not in record.pathname


def run(main, config_sets_flags: bool = True) -> None:
  """app.run(main) with --config applied (unless the launcher reads its config itself), the
  compilation cache on, and one-line usage errors. On Linux it first restarts the process once
  so that its weights and caches can sit in 2 MB pages (hitree_jax/huge_pages.py), unless
  launch/__init__.py already has."""
  from hitree_jax import huge_pages, topology
  huge_pages.reexec_if_needed()
  topology.skip_absent_tpu()

  def checked(argv):
    logging.get_absl_handler().addFilter(_quiet_orbax)  # it logs every save and load at INFO
    if len(argv) > 1:
      _fail(app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}"))
    _load_config()
    try:
      if config_sets_flags:
        apply_config()
      from hitree_jax import compile_cache
      compile_cache.enable()
      return main(argv)
    except (UsageError, app.UsageError, flags.Error) as e:
      _fail(e)

  _help_shows_every_flag_of(main.__module__)
  app.run(checked, flags_parser=_parse_flags)


def _help_shows_every_flag_of(launcher: str) -> None:
  """--help prints the flags key to the main program, which absl names by sys.argv[0]: the
  launcher's own when run with -m, none at all for a console script (hitree-generate), and never
  those defined here (--draft, --model, --temperature...). Declare them all key to it."""
  FLAGS = flags.FLAGS
  for module in (launcher, __name__):
    for flag in FLAGS.get_flags_for_module(module):
      FLAGS.register_key_flag_for_module(sys.argv[0], flag)


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


def define_cache_sizing_flag():
  flags.DEFINE_integer("size_caches_for", 0, "Size every generation's caches for prompts of up to this "
                       "many tokens (a longer batch is sized for itself): one compiled decode program then "
                       "serves them all. Worth it where compiling is slow and a step costs about the same "
                       "over more slots (a GPU or TPU at short contexts); on a CPU a step reads every slot. "
                       "0: each batch's own prompts, rounded up to 256 slots.")


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
  flags.DEFINE_integer("coordinator_timeout", 300, "Multi-host: seconds a process waits for all the "
                       "others to join before it gives up.")
  flags.DEFINE_integer("heartbeat_timeout", 100, "Multi-host: seconds without word from a process "
                       "after which the others take it for dead and stop.")


def mesh_from_flags(FLAGS):
  """Joins the other processes (multi-host: jax.distributed.initialize) and builds --mesh over the
  devices of all of them (None: one device). Call before anything else uses jax."""
  from hitree_jax import sharding
  axes = sharding.parse_mesh(FLAGS.mesh)
  multi = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if any(x is not None for x in multi):
    if any(x is None for x in multi):
      raise UsageError("multi-host needs all of --coordinator_address, --num_processes and --process_id")
    if not 0 <= FLAGS.process_id < FLAGS.num_processes:
      raise UsageError(f"--process_id={FLAGS.process_id} must be in [0, --num_processes="
                       f"{FLAGS.num_processes})")
    if not axes:
      raise UsageError("multi-host needs a --mesh over the processes' devices (e.g. --mesh=model:2)")
    for name in ("coordinator_timeout", "heartbeat_timeout"):
      if FLAGS[name].value < 1:
        raise UsageError(f"--{name}={FLAGS[name].value}: give seconds, at least 1")
    import jax
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                               initialization_timeout=FLAGS.coordinator_timeout,
                               heartbeat_timeout_seconds=FLAGS.heartbeat_timeout)
  return sharding.make_mesh(axes)


def writes_outputs() -> bool:
  """Whether this process writes the run's files (records, tables, plots): the only process of a
  one-host run, process 0 of a multi-host one, whose processes all compute the same figures."""
  import jax
  return jax.process_index() == 0


def define_text_flag(default: str | None, help: str):
  """--text, the kind of text a launcher reads (data.TEXTS: a book corpus's name, or chat): one
  name and one spelling in every launcher."""
  from hitree_jax.data import TEXTS
  flags.DEFINE_enum("text", default, list(TEXTS), help)


def define_sampling_flags():
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1 = off.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
  flags.DEFINE_integer("seed", 0, "PRNG seed: a run is reproducible from it.")


def define_speculation_flags():
  """The flags of methods.Knobs' fields, each with its default there (one place for both)."""
  knobs = methods.Knobs()
  flags.DEFINE_string("draft", knobs.draft, "Drafter: self:K[,iid|without_replacement|deterministic] "
                      "(the target's first K layers), ngram[:N] (prompt lookup), eagle:PATH[,mode] "
                      "or medusa:PATH[,mode] (drafts on the target's features, e.g. "
                      "eagle:drafts/smollm2-eagle), or PATH[,mode]: a separate draft model (e.g. "
                      "drafts/smollm2-draft.gguf).")
  flags.DEFINE_integer("gamma", knobs.gamma, "Draft tokens per round for --method=sd and --method=retrieval.")
  flags.DEFINE_string("step_aside", knobs.step_aside, "--method=sd, tree and hsd "
                      "(--method=auto sets it from its plan): BELOW[:ROUNDS[:MEMORY]]. A row whose running "
                      "mean of accepted tokens per round (over MEMORY rounds, default 4) falls below BELOW runs ROUNDS (default 16) "
                      "plain one-token rounds, then tries its drafter again; the output is unchanged.")
  flags.DEFINE_string("tree", knobs.tree, "Tree for --method=tree (default kary:2x2) and --method=hitree "
                      "(default kary:2x4, HiTree's binary tree of depth 4): chain:N, kary:KxD, "
                      "sequoia:BUDGET,DEPTH (the best tree for --acceptance) or dynamic:BUDGET,DEPTH "
                      "(EAGLE-2: the BUDGET most probable of the draft's candidates, chosen each round).")
  flags.DEFINE_string("acceptance", knobs.acceptance, "Sequoia trees: the draft's per-rank acceptance "
                      "probabilities, comma-separated, or a JSON file holding 'acceptance_profile' "
                      "(launch.distill writes DRAFT.json next to each draft: the default for a draft "
                      "model).")
  flags.DEFINE_integer("budget", knobs.budget, "Retrieval cache slots (chunks of 8, the sink chunk kept) of "
                       "the target's retrieval level: --method=retrieval, triforce, hitree.")
  flags.DEFINE_integer("reselect", knobs.reselect, "The retrieval level chooses its chunks again, with the "
                       "newest token's query, every this many committed tokens (at the end of a "
                       "block; 0: once, after prefill, as TriForce does).")
  flags.DEFINE_integer("sinks", knobs.sinks, "StreamingLLM cache of the bottom draft (triforce, hitree): "
                       "attention-sink tokens kept (TriForce: 16).")
  flags.DEFINE_integer("window", knobs.window, "StreamingLLM cache of the bottom draft: most recent tokens "
                       "kept (TriForce: 234).")
  flags.DEFINE_integer("gamma1", knobs.gamma1, "Draft tokens per round from the bottom draft to the "
                       "retrieval level, --method=triforce (default 1, TriForce's).")
  flags.DEFINE_integer("gamma2", knobs.gamma2, "Tokens the retrieval level buffers before the target "
                       "verifies them: --method=triforce (default 6) and hitree (default 12).")
  define_feature_draft_flag()
  flags.DEFINE_string("levels", knobs.levels, "--method=hsd: the stack below the target, bottom-up, levels "
                      "joined by '+': DRAFTER/TREE first (DRAFTER: ngram[:N], self:K, draft (the "
                      "--draft model) or PATH, [@streaming:SINKSxWINDOW], [,MODE]; or retrieval:BUDGET), "
                      "then WHO/GAMMA per level (WHO: retrieval:BUDGET[:RESELECT] or draft[@streaming:SxW]). "
                      "e.g. ngram:3/chain:2+draft/4+retrieval:1024/6 (docs/methods.md).")


def define_feature_draft_flag():
  flags.DEFINE_string("feature_draft", None, "--method=auto (and launch.plan): an EAGLE draft, "
                      "eagle:PATH (e.g. eagle:drafts/smollm2-eagle), that the planner also weighs as the "
                      "bottom level, under the target or a retrieval level.")


def knobs_from_flags(FLAGS) -> methods.Knobs:
  """The speculation flags as a method's options."""
  return methods.Knobs(**{f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(methods.Knobs)})


def sampling_from_flags(FLAGS):
  from hitree_jax.decode.sampling import SamplingParams
  return SamplingParams.create(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k)


def positive_ints(name: str) -> list[int]:
  """A comma-separated list flag (--prompt_tokens, --batch_sizes) as numbers, each at least 1."""
  given = ",".join(flags.FLAGS[name].value)
  try:
    values = [int(v) for v in flags.FLAGS[name].value]
  except ValueError:
    raise UsageError(f"--{name}={given}: expected comma-separated integers") from None
  if not values or min(values) < 1:
    raise UsageError(f"--{name}={given}: give at least one, each at least 1")
  return values
