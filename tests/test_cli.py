"""A new user's first hour: the README, config files, clean errors, the compilation cache, packaging."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

from hitree_jax import errors, shipped, topology

from tests.helpers import REPO, real_model_environ
README = (REPO / "README.md").read_text()


def launch(module, *args, env=None, cwd=REPO, timeout=600):
  return subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, **(env or {})})


def code_blocks(language: str, text: str = README) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", text, re.S)


# ---- the README stands alone ----

def test_readme_points_only_inside_the_repository():
  assert "../" not in README and "shared/" not in README
  for target in re.findall(r"\]\(([^)#]+)\)", README):
    if not target.startswith("http"):
      assert (REPO / target).exists(), target


def test_readme_first_block_is_the_two_ci_commands():
  """.ci/run runs the first bash block's two commands; both must be what the README says."""
  commands = [line for line in code_blocks("bash")[0].splitlines()
              if line.strip() and not line.startswith("#")]
  assert len(commands) == 2
  assert commands[0].startswith("./setup.sh && ") and "launch.generate --model=smollm2" in commands[0]
  assert commands[1].startswith("./setup.sh --test && ") and "pytest" in commands[1]


@pytest.mark.parametrize("doc", ["README.md", "docs/own_model.md"])
def test_launcher_flags_in_the_docs_exist(doc):
  """Every --flag in the command examples is a flag of the launcher it is given to."""
  import shlex
  known = {}
  for block in code_blocks("bash", (REPO / doc).read_text()):
    for line in block.replace("\\\n", " ").splitlines():  # continuation lines joined
      words = shlex.split(line, comments=True)
      for i, word in enumerate(words):
        if word == "-m" and words[i + 1].startswith("launch."):
          module = words[i + 1].split(".")[1]
          args = [w for w in words[i + 2:] if w.startswith("--")]
          names = {a[2:].split("=")[0].split(".")[0] for a in args}
          known.setdefault(module, _flag_names(module))
          assert names <= known[module], (module, names - known[module])


@functools.cache   # each launcher's flags once for both documents (a launcher process each, about 1 s)
def _flag_names(module: str) -> set[str]:
  proc = launch(module, "--helpfull", timeout=120)
  return set(re.findall(r"^\s+--(?:\[no\])?([\w]+)", proc.stdout, re.M))


@pytest.mark.slow
def test_readme_library_example_runs():
  (example,) = code_blocks("python")
  proc = subprocess.run([sys.executable, "-c", example], cwd=REPO, capture_output=True, text=True,
                        timeout=900, env=real_model_environ())
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = proc.stdout.strip().splitlines()
  assert len(printed) == 3
  assert 0 < float(printed[0].rsplit(" ", 1)[1])           # ar: decode tokens per second
  assert 1.0 <= float(printed[1].rsplit(" ", 1)[1]) <= 3.0  # sd, by name: tokens per target forward
  # TriForce by name: its two levels, each with what it accepted
  assert "'target[retrieval:256]/6'" in printed[2] and "'proposer': 'draft[streaming:16x234]'" in printed[2]


# ---- config files ----

CONFIGS = {"methods.py": "generate", "models.py": "generate", "benchmarks.py": "benchmark",
           "distill_smollm2.py": "distill", "distill_eagle.py": "distill"}


@pytest.mark.parametrize("name", ["llama2_7b_128k.py", "llama3_8b_128k.py", "smollm2_8k.py", "llama3_8b_eagle3.py",
                                  "qwen3_8b_dflash.py"])
def test_every_shapes_config_makes_its_models_and_stack(name):
  """launch.plan_memory's and launch.level_cost's shapes configs: each makes its target (and its
  draft model, where its stack has one) and its stack (memory_plan.shapes_stack: TriForce's, or
  its levels with a published draft read from its config.json alone), and its prompt fits the
  target's context. (.ci/runtime_smoke plans a small shape; compiling these takes minutes.)"""
  import importlib.util
  from hitree_jax import memory_plan
  from hitree_jax.heads.drafter import DFlashDrafter, EagleDrafter
  from hitree_jax.tree.shapes import DynamicTree
  spec = importlib.util.spec_from_file_location(name[:-3], REPO / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  target, draft = memory_plan.shapes_models(cfg)
  stack = memory_plan.shapes_stack(cfg, target, draft)
  assert cfg.prompt_tokens + cfg.max_new_tokens <= target.max_position_embeddings
  if cfg.get("levels") is None:
    assert stack.verifiers[0].cache.budget == cfg.budget and stack.drafter.cache.window == cfg.window
  elif "eagle3" in name:   # EAGLE-3: three taps, a 32K draft vocabulary mapped into the target's
    assert isinstance(stack.drafter, EagleDrafter) and str(stack.drafter) == "eagle3"
    assert stack.drafter.taps == (1, 15, 28) and stack.drafter.config.vocab_size == 32001
    assert stack.tree.budget == 60 and draft is None
  else:                    # DFlash: a block of 16 from five taps, as a chain of 15 or as TREE
    assert isinstance(stack.drafter, DFlashDrafter) and stack.drafter.taps == (1, 9, 17, 25, 33)
    assert stack.tree.max_depth == 15 and stack.drafter.config.num_layers == 5
    cfg.levels = module.TREE
    assert memory_plan.shapes_stack(cfg, target, draft).tree == DynamicTree(32, 8)


@pytest.mark.parametrize("name,module", CONFIGS.items())
def test_every_config_preset_names_only_flags_of_its_launcher(name, module):
  import importlib.util
  spec = importlib.util.spec_from_file_location(name[:-3], REPO / "configs" / name)
  config_module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(config_module)
  presets = [p for p in ("PRESETS", "PAIRS", "SUITES") if hasattr(config_module, p)]
  arguments = list(getattr(config_module, presets[0])) if presets else [None]
  known = _flag_names(module)
  for argument in arguments:
    config = config_module.get_config(argument) if argument else config_module.get_config()
    assert set(config.keys()) <= known, (name, argument, set(config.keys()) - known)


def test_config_sets_flags_and_the_command_line_wins():
  """--config presets set flags; an explicit flag or --config.NAME override beats them."""
  proc = launch("generate", "--config=configs/methods.py:sd", "--config.gamma=600", "--text=austen")
  assert proc.returncode == 2 and "gamma" in proc.stderr  # the override reached the flag
  proc = launch("generate", "--config=configs/methods.py:sd", "--tree=kary:2x2", "--text=austen")
  assert proc.returncode == 2 and "--tree does not apply to --method=sd" in proc.stderr


# ---- mistakes: one line, exit code 2, before the model loads ----

@pytest.mark.parametrize("args,message", [
    (["--text=austen", "--method=sd", "--tree=kary:2x2"], "--tree does not apply to --method=sd"),
    (["--text=austen", "--method=tree", "--tree=kary:10x10"], "asks for 11111111110 nodes"),
    (["--text=austen", "--method=tree", "--tree=kary:2"], "bad tree spec 'kary:2'"),
    (["--prompt="], "the prompt is empty"),
    (["--prompt=hi", "--temperature=-1"], "temperature=-1.0"),
    (["--prompt=hi", "--top_p=1.5"], "top_p=1.5"),
    (["--prompt=hi", "--max_new_tokens=0"], "--max_new_tokens=0"),
    (["--prompt=hi", "--mesh=model:1", "--coordinator_address=localhost:1", "--num_processes=2", "--process_id=0",
      "--coordinator_timeout=0"], "--coordinator_timeout=0: give seconds, at least 1"),
    (["--text=austen", "--prompt_tokens=8190", "--max_new_tokens=128"], "8318 > the model's context of 8192"),
    (["--text=milton", "--model=no/such/model.gguf"], "model 'no/such/model.gguf' not found"),
    (["--text=austen", "--method=sd", "--draft=no_such_draft.gguf"], "not found"),
    (["--text=austen", "--method=sd", "--draft=eagle:no/such/eagle"],
     "eagle draft 'no/such/eagle' not found: expected a folder with heads.json"),
    (["--text=austen", "--method=hsd", "--levels=ngram/chain:2+eagle:x/3"],
     "eagle:x only proposes (it must be the bottom level)"),
    (["--text=nope"], "--text=nope"),
    (["--book=austen"], "--book is now --text=BOOK"),
    (["--prompt=hi", "--chat"], "--chat is now --text=chat"),
    (["--prompt=hi", "extra"], "unexpected arguments: extra"),
    (["--config=configs/no_such.py", "--prompt=hi"], "no_such.py"),
    (["--text=austen", "--method=triforce", "--gamma=3"], "--gamma does not apply to --method=triforce"),
    (["--text=austen", "--method=hitree", "--draft=drafts/smollm2-draft.gguf", "--budget=100"],
     "budget=100 must be a multiple of chunk=8"),
    (["--text=austen", "--method=triforce", "--draft=self:8"], "give --draft=PATH"),
    (["--text=austen", "--method=hsd", "--levels=self:4@streaming:4x8/2+retrieval:512/4"],
     "self:4 keeps no cache of its own"),
    (["--text=austen", "--method=hsd"], "--method=hsd needs its levels"),
    (["--text=austen", "--method=hsd", "--levels=ngram:3/chain:2+self:2/3"], "only proposes"),
    (["--text=austen", "--method=hsd", "--levels=ngram:3/chain:2+retrieval:512/x"],
     "expected retrieval:BUDGET/GAMMA"),
    (["--text=austen", "--method=hsd", "--levels=ngram/dynamic:4,2+retrieval:512/4"], "dynamic tree"),
    (["--text=austen", "--method=hsd", "--levels=ngram:3/chain:2+retrieval:512:x/4"],
     "expected retrieval:BUDGET or retrieval:BUDGET:RESELECT"),
    (["--text=austen", "--method=sd", "--reselect=64"], "--reselect does not apply to --method=sd"),
    (["--prompt_file=no/such/prompt.txt"], "--prompt_file=no/such/prompt.txt: no such file"),
    (["--prompt_file=tests/data/not_utf8.txt"], "--prompt_file=tests/data/not_utf8.txt: not UTF-8"),
    (["--config=methods:no_such_preset", "--prompt=hi"], "unknown method preset 'no_such_preset'"),
    (["--text=austen", "--model=smollm2-eagle"],
     "'smollm2-eagle' holds eagle heads, not a model: use --draft=eagle:smollm2-eagle"),
])
def test_user_mistakes_are_one_line_and_exit_2(args, message):
  proc = launch("generate", *args, env={"HITREE_COMPILE_CACHE": "off"})
  lines = [line for line in proc.stderr.splitlines() if not re.match(r"[IWE]\d{4} ", line)]
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize("module", ["plan_memory", "level_cost", "plan", "benchmark"])
def test_a_missing_config_is_one_line_in_every_launcher(module):
  proc = launch(module, "--config=configs/no_such.py")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      f"error: --config=configs/no_such.py: no such file (a configs/*.py file, or a shipped "
      f"config's name: {', '.join(shipped.names('configs', '.py'))})"]


def test_the_old_overheads_flag_names_the_full_profile():
  proc = launch("plan", "--draft=smollm2-draft", "--noreuse_overheads")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == ["error: --noreuse_overheads is now --full_profile (a full measurement)"]


def test_a_mistake_is_the_only_line_even_where_libtpu_is_installed():
  """With libtpu installed (a test package here) and no TPU, jax's start-up would print
  libtpu's failure to find one before the error; the launcher keeps jax to the CPU instead."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run([sys.executable, "-m", "launch.generate", "--model=no/such/folder",
                         "--prompt=hi"], cwd=REPO, capture_output=True, text=True, timeout=600,
                        env={**env, "HITREE_COMPILE_CACHE": "off"})
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "error: model 'no/such/folder' not found: expected one of ('smollm2',), a .gguf file, an HF "
      "folder with config.json, or a checkpoint from launch.convert"]


@pytest.mark.parametrize("imports", ["import hitree_jax.decode.engine\nimport jax",
                                     "import jax\nimport hitree_jax.decode.engine"])
def test_library_use_is_quiet_where_libtpu_is_installed(imports):
  """Importing the library, before jax or after it, keeps jax from libtpu's failed TPU search."""
  assert topology.tpu_compiler_installed() and not topology.tpu_attached()
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = imports + "\nprint(jax.devices()[0].platform, float(jax.numpy.ones(3).sum()))"
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=600, env=env)
  assert (proc.returncode, proc.stdout, proc.stderr) == (0, "cpu 3.0\n", "")


RUN_MAIN = """
import sys
from hitree_jax import errors
from hitree_jax.launch import common
def main(argv):
  raise {error}("the bad value is 42")
common.run(main)
"""


@pytest.mark.parametrize("error,switch,one_line", [
    ("errors.UsageError", None, True),       # a user's mistake: one line, exit code 2
    ("errors.NotFound", "0", True),          # 0 means off, as HITREE_HUGE_PAGES=0 does
    ("errors.UsageError", "1", False),       # asked for: its traceback
    ("ValueError", None, False),             # a bug keeps its traceback, whatever its type
    ("KeyError", None, False),
])
def test_only_a_users_mistake_loses_its_traceback(error, switch, one_line):
  env = {k: v for k, v in os.environ.items() if k != "HITREE_TRACEBACK"}
  env["HITREE_HUGE_PAGES"] = "0"   # no re-execution: `python -c` has no file to run again
  if switch is not None:
    env["HITREE_TRACEBACK"] = switch
  proc = subprocess.run([sys.executable, "-c", RUN_MAIN.format(error=error)],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  if one_line:
    assert proc.returncode == 2 and proc.stderr == "error: the bad value is 42\n", proc.stderr
  else:
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "42" in proc.stderr


@pytest.mark.parametrize("value,default,expected", [
    (None, False, False), (None, True, True), ("0", True, False), ("false", True, False),
    ("", True, False), ("1", False, True), ("yes", False, True), ("Off", True, False),
])
def test_env_switches_read_one_way(value, default, expected):
  environ = {} if value is None else {"HITREE_X": value}
  assert errors.env_switch("HITREE_X", default, environ) is expected


def test_the_compile_cache_switch_reads_like_the_others(tmp_path):
  """$HITREE_COMPILE_CACHE is a folder or a switch: off as every switch is off (no folder named
  `false`), on for the default folder."""
  from hitree_jax import compile_cache
  default = compile_cache.default_dir({})
  assert default.name == "xla_cache"
  for off in ("0", "false", "No", "off", "", " none "):
    assert compile_cache.default_dir({compile_cache.ENV: off}) is None, off
  for on in ("1", "true", "yes", "ON"):
    assert compile_cache.default_dir({compile_cache.ENV: on}) == default, on
  assert compile_cache.default_dir({compile_cache.ENV: str(tmp_path / "x")}) == tmp_path / "x"
  assert compile_cache.default_dir({compile_cache.ENV: "~/x"}) == pathlib.Path.home() / "x"


@pytest.mark.slow
def test_draft_with_another_tokenizer_is_refused(tmp_path):
  """A draft whose tokenizer differs (here: one merge rule dropped) is named before any load."""
  import gguf
  from hitree_jax.loading import smollm2_gguf_path
  from hitree_jax.loading.gguf import open_reader
  reader = open_reader(smollm2_gguf_path())
  writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "llama")
  for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    value = field.contents()
    if key == "tokenizer.ggml.merges":
      value = value[:-1]
    writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  proc = launch("generate", "--text=austen", "--method=sd", f"--draft={tmp_path / 'other.gguf'}",
                env={"HITREE_COMPILE_CACHE": "off"})
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "has a different tokenizer from the target's" in proc.stderr


# ---- the persistent compilation cache ----

@pytest.mark.slow
def test_second_run_compiles_nothing(tmp_path):
  """A second run of the same command loads every program from the persistent cache. On a
  one-layer random model with SmolLM2's tokenizer: what is cached does not depend on the size."""
  from tests.helpers import tiny_model_gguf
  model = tiny_model_gguf(tmp_path / "tiny.gguf")
  args = (f"--model={model}", "--text=austen", "--prompt_tokens=32", "--max_new_tokens=4", "--method=sd",
          "--draft=ngram", "--gamma=2", "--json")
  env = {"HITREE_COMPILE_CACHE": str(tmp_path / "xla")}
  first, second = (json.loads(launch("generate", *args, env=env).stdout.splitlines()[-1])
                   for _ in range(2))
  assert first["compiles"] >= 3 and first["cache_loads"] == 0
  assert second["compiles"] == 0 and second["cache_loads"] == first["compiles"]
  assert second["tokens"] == first["tokens"]


# ---- packaging ----

@pytest.mark.slow
def test_installed_package_runs_its_launchers_outside_the_repository(tmp_path):
  """The wheel holds both packages, the pinned dependencies and console scripts, and a launcher
  imported from the installed copy (not the checkout) runs from another folder."""
  import shutil
  source = tmp_path / "source"  # setuptools builds in the source tree: build a copy
  shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
      ".*", "assets", "build", "*.egg-info", "runs", "checkpoints", "results*", "__pycache__"))
  build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                         timeout=600)
  assert build.returncode == 0, build.stderr[-3000:]
  (wheel,) = (tmp_path / "dist").glob("hitree_jax-*.whl")
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    scripts = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
  assert "hitree_jax/launch/generate.py" in names and "hitree_jax/decode/engine.py" in names
  assert not any(n.startswith("launch/") for n in names)   # no top-level `launch` module
  assert "Requires-Dist: jax==0.10.2" in meta and "Requires-Dist: ml_collections==1.1.0" in meta
  assert "torch" not in meta.split("Provides-Extra: test")[0]
  assert "hitree-generate = hitree_jax.launch.generate:run" in scripts
  target = tmp_path / "site"
  install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                            str(target), str(wheel)], capture_output=True, text=True, timeout=600)
  assert install.returncode == 0, install.stderr[-3000:]
  assert {"hitree_jax/files/drafts/smollm2-draft.gguf", "hitree_jax/files/drafts/smollm2-eagle/heads.json",
          "hitree_jax/files/configs/methods.py", "hitree_jax/files/data/spec_bench/question.jsonl"} <= set(names)
  found = ("import pathlib, sys; from hitree_jax import shipped, spec_bench; files = pathlib.Path(sys.argv[1]) / "
           "'hitree_jax' / 'files'; assert shipped.__file__.startswith(sys.argv[1]); "
           "assert shipped.find('smollm2-draft') == shipped.find('drafts/smollm2-draft.gguf') == "
           "files / 'drafts' / 'smollm2-draft.gguf'; "
           "assert shipped.find('smollm2-eagle') == files / 'drafts' / 'smollm2-eagle'; "
           "assert shipped.find('methods', 'configs', ('', '.py')) == files / 'configs' / 'methods.py'; "
           "assert spec_bench.QUESTIONS == files / 'data' / 'spec_bench' / 'question.jsonl'; "
           "assert 'methods' in shipped.names('configs', '.py')")
  proc = subprocess.run([sys.executable, "-c", found, str(target)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(target)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  code = ("import sys, hitree_jax.launch.generate as g; assert g.__file__.startswith(sys.argv[1]), g.__file__; "
          "sys.argv = ['hitree-generate', '--prompt=']; g.run()")
  proc = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(target)})
  assert proc.returncode == 2 and "error: the prompt is empty" in proc.stderr, proc.stderr[-2000:]


def test_distill_recipe_is_the_shipped_drafts():
  """configs/distill_smollm2.py reproduces drafts/smollm2-draft.gguf: its settings are what the
  draft's evaluation recorded, and the launcher's defaults are the recipe's."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("recipe", REPO / "configs" / "distill_smollm2.py")
  recipe_module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(recipe_module)
  recipe = recipe_module.get_config()
  record = json.loads((REPO / "drafts" / "smollm2-draft.json").read_text())
  assert [int(x) for x in recipe.layers.split(",")] == record["layers"]
  for name in ("vocab_size", "window", "eval_windows", "temperature", "top_p", "cost_context"):
    assert recipe[name] == record[name], name
  # it writes under runs/, not over the draft it reproduces (that takes --out=drafts/...)
  assert record["out"] == "drafts/smollm2-draft.gguf" and recipe.out.startswith("runs/")
  command = dict(arg[2:].split("=", 1) for arg in record["command"].split()[3:])
  assert int(command["steps"]) == recipe.steps and int(command["train_windows"]) == recipe.train_windows
  defaults = _flag_defaults("distill")
  for name, value in recipe.items():
    expected = value.split(",") if name == "layers" else value
    assert name in ("workdir", "out") or defaults[name] == expected, (name, defaults[name], value)
  assert defaults["out"] is None   # by default the export goes under --workdir


def test_eagle_recipe_is_the_shipped_eagle_drafts():
  """configs/distill_eagle.py holds the settings drafts/smollm2-eagle was trained with (its
  heads.json's command) and evaluated at."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("eagle_recipe", REPO / "configs" / "distill_eagle.py")
  recipe_module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(recipe_module)
  recipe = recipe_module.get_config()
  shipped = json.loads((REPO / "drafts" / "smollm2-eagle" / "heads.json").read_text())
  command = dict(arg[2:].split("=", 1) for arg in shipped["command"].split()[3:])
  defaults = _flag_defaults("distill")
  for name, value in recipe.items():
    if name in ("workdir", "out"):
      continue
    used = command.get(name, defaults[name])
    assert type(value)(used) == value if not isinstance(value, bool) else str(used) == str(value), (name, used)
  for name in ("vocab_size", "window", "eval_windows", "temperature", "top_p", "cost_context"):
    assert shipped["evaluation"][name] == recipe[name], name


def _flag_defaults(module: str) -> dict:
  code = (f"import json, launch.{module}; from absl import flags; "
          "print(json.dumps({n: flags.FLAGS[n].default for n in flags.FLAGS}, default=str))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  return json.loads(proc.stdout.splitlines()[-1])


def test_the_speculation_flags_are_the_knobs_with_their_defaults():
  """launch.generate's speculation flags are methods.Knobs' fields, each with Knobs' default: the
  flags and the library's method(...) read one table."""
  import dataclasses
  from hitree_jax import methods
  proc = launch("generate", "--helpfull", timeout=120)
  blocks = dict(re.findall(r"^\s+--(\w+):(.*?)(?=^\s+--|\Z)", proc.stdout, re.M | re.S))
  for field in dataclasses.fields(methods.Knobs):
    assert field.name in blocks, field.name
    shown = re.search(r"\(default: '?([^')]*)'?\)", blocks[field.name])   # absl shows no None
    default = getattr(methods.Knobs(), field.name)
    assert (shown and shown.group(1)) == (None if default is None else str(default)), field.name
