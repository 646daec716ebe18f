"""The absl launchers end to end, as a user runs them (subprocesses, real SmolLM2)."""

import json
import os
import subprocess
import sys

import pytest

from hitree_jax import huge_pages

from tests.helpers import REPO, launch



def test_the_launch_modules_tests_import_share_one_process():
  """Tests import some launch modules in-process; two that define the same absl flag (every
  model launcher defines --model) fail only when pytest-xdist puts them on one worker. Importing
  them all in one process makes that failure certain instead of a matter of scheduling."""
  import re
  imported = set()
  for test in (REPO / "tests").glob("test_*.py"):
    for line in test.read_text().splitlines():
      found = re.match(r"\s*from launch(?:\.(\w+))? import ([\w, ]+)$", line)
      if found:
        imported |= {found[1]} if found[1] else {name.strip() for name in found[2].split(",")}
  assert {"plots", "tables", "fetch_assets"} <= imported
  code = "; ".join(f"import launch.{name}" for name in sorted(imported))
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]

@pytest.mark.slow
def test_generate_json_record(tiny_model):
  """The record's fields (on the one-layer model: they do not depend on its size)."""
  proc = launch("generate", f"--model={tiny_model}", "--text=austen", "--prompt_tokens=64",
                "--max_new_tokens=6", "--ignore_eos", "--temperature=0.6", "--top_p=0.9",
                "--key_dtype=bfloat16", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert record["settings"]["key_dtype"] == "bfloat16"
  for key in ("prompt_ids", "tokens", "text", "prefill_s", "decode_s", "decode_tokens_per_s", "compile_s"):
    assert key in record, key
  assert len(record["prompt_ids"]) == 64 and len(record["tokens"]) == 6
  assert record["compile_s"] > 0 and record["decode_tokens_per_s"] > 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  from tests.helpers import tiny_model_gguf
  return tiny_model_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.mark.slow
def test_benchmark_writes_json_table_and_plots(tiny_model, tmp_path):
  out = tmp_path / "bench.json"
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=ar,sd/ngram/2", "--prompt_tokens=32,48",
                "--max_new_tokens=4", "--n_prompts=2", "--text=austen", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(out.read_text())
  assert record["max_new_tokens"] == 4 and record["text"] == "austen"
  # the launcher restarted itself with glibc's malloc asking for 2 MB pages, where that gets them
  assert record["memory_pages"] == huge_pages.describe(huge_pages.launcher_environ(os.environ))
  # what it ran on: the CPU's name, the jax version and the commit (a checkout: short hash)
  import jax
  from hitree_jax import provenance
  assert record["jax"] == jax.__version__ and record["cpu"] == provenance.cpu_name()
  assert record["commit"] is not None and record["commit"].split("+")[0] == provenance.commit().split("+")[0]
  assert record["command"].startswith("python -m launch.benchmark ") and "--methods=ar,sd/ngram/2" in record["command"]
  assert "new_tokens" not in record and "corpus" not in record
  assert [(r["method"], r["prompt_tokens"]) for r in record["results"]] == [
      ("ar", 32), ("sd/ngram/2", 32), ("ar", 48), ("sd/ngram/2", 48)]
  for row in record["results"]:
    assert len(row["runs"]) == 2 and row["median_decode_tokens_per_s"] > 0
    assert all(run["new_tokens"] == 4 and run["compiles"] == 0 for run in row["runs"])
    # greedy: every method's tokens were compared with ar's on every prompt, and equal them
    assert row.get("differs_from_ar") == (None if row["method"] == "ar" else [])
  table = (tmp_path / "bench.md").read_text()
  assert "| ar | 32 |" in table and " greedy = ar |" in table and table.count(" | yes |") == 2
  for name in ("bench_speed.png", "bench_acceptance.png"):
    png = (tmp_path / name).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, name
  # 2 lengths x 2 methods x (warm-up + 2 prompts) timed runs, each a progress line with an ETA.
  assert "benchmark 1/12 (8%) elapsed" in proc.stderr and "benchmark 12/12 (100%)" in proc.stderr
  # sampled: nothing to compare with ar's tokens, and nothing compared
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=ar,sd/ngram/2", "--prompt_tokens=32",
                "--max_new_tokens=4", "--n_prompts=1", "--temperature=0.6", "--time_levels=false",
                f"--out={tmp_path / 'sampled.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "sampled.json").read_text())["results"]
  assert [r["method"] for r in rows] == ["ar", "sd/ngram/2"] and not any("differs_from_ar" in r for r in rows)
  # sampled at three seeds: a run per prompt and seed, each a sample of its own
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=ar", "--prompt_tokens=32", "--max_new_tokens=4",
                "--n_prompts=1", "--temperature=1.0", "--seed=5", "--seeds=3", "--time_levels=false",
                f"--out={tmp_path / 'seeds.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads((tmp_path / "seeds.json").read_text())
  assert record["seeds"] == 3 and [run["seed"] for run in record["results"][0]["runs"]] == [5, 6, 7]
  assert "benchmark 4/4 (100%)" in proc.stderr and "prompt 0 seed 7:" in proc.stderr
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=ar", "--prompt_tokens=32", "--seeds=2")
  assert proc.returncode != 0 and "--seeds=2: greedy decoding gives the same tokens at every seed" in proc.stderr
  # batches of 2 passages: each run decodes two distinct passages, every row compared with ar's
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=ar,sd/ngram/2", "--prompt_tokens=32",
                "--max_new_tokens=4", "--n_prompts=2", "--batch_sizes=2", "--time_levels=false",
                f"--out={tmp_path / 'batched.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "batched.json").read_text())["results"]
  assert [(r["method"], r["batch_size"]) for r in rows] == [("ar", 2), ("sd/ngram/2", 2)]
  assert all(run["rows"] == 2 and run["new_tokens"] == 8 for r in rows for run in r["runs"])
  assert rows[1]["differs_from_ar"] == []
  table = (tmp_path / "batched.md").read_text()
  assert "| sd/ngram/2 | 32 | 2 |" in table and not (tmp_path / "batched_speed.png").exists()


def test_plots_normalise_acceptance_per_round(tmp_path):
  from launch import plots
  run = lambda per_depth, rounds: {"accepted_per_depth": per_depth, "target_forwards": rounds}
  rows = [{"method": "ar", "prompt_tokens": 8, "median_decode_tokens_per_s": 10.0,
           "runs": [{"accepted_per_depth": None, "target_forwards": None}]},
          {"method": "sd/ngram/2", "prompt_tokens": 8, "median_decode_tokens_per_s": 12.0,
           "runs": [run([3, 1], 4), run([5, 2], 6)]}]
  assert plots.acceptance_per_depth(rows[1:]) == [0.8, 0.3]  # (3+5)/10, (1+2)/10
  assert plots.acceptance_per_depth(rows[:1]) is None
  record = {"model": "m", "temperature": 0.0, "results": rows}
  assert plots.acceptance_figure(record, tmp_path / "a.png") and (tmp_path / "a.png").is_file()
  assert not plots.acceptance_figure({**record, "results": rows[:1]}, tmp_path / "b.png")
  assert not (tmp_path / "b.png").exists()


def hierarchy_row(method, depth, size, gamma2, speed, levels):
  run = {"levels": levels, "accepted_per_depth": [1] * depth, "target_forwards": 10}
  return {"method": method, "prompt_tokens": 64, "median_decode_tokens_per_s": speed,
          "tree_depth": depth, "tree_size": size, "gammas": [gamma2], "runs": [run, run]}


def level(name, proposer, proposed, accepted, forwards, round_ms, share, **more):
  return {"name": name, "proposer": proposer, "proposed": proposed, "accepted": accepted,
          "acceptance": accepted / proposed, "forwards": forwards, "round_ms": round_ms,
          "time_share": share, **more}


def test_level_plots_and_table(tmp_path):
  from launch import plots, tables
  def levels(middle_accepted, top_accepted):
    return [level("target[retrieval:1024]/6", "draft[streaming:16x234]", 40, middle_accepted, 30, 30.0,
                  0.5, proposer_round_ms=3.0, proposer_time_share=0.05),
            level("target", "target[retrieval:1024]/6", 60, top_accepted, 10, 60.0, 0.3)]
  rows = [{"method": "ar", "prompt_tokens": 64, "median_decode_tokens_per_s": 10.0,
           "runs": [{"levels": None}]},
          hierarchy_row("triforce", 1, 1, 6, 9.0, levels(18, 45)),
          hierarchy_row("hitree2", 2, 6, 6, 11.0, levels(30, 54)),
          hierarchy_row("hitree4", 4, 30, 6, 10.5, levels(32, 50))]
  assert plots.level_acceptance(rows[1:2]) == [18 / 40, 45 / 60]  # pooled over the two runs
  shares = plots.time_shares(rows[1:2])
  assert list(shares.values()) == [0.05, 0.5, 0.3]
  assert list(shares)[0] == "drafting (draft[streaming:16x234])"
  record = {"model": "m", "temperature": 0.6, "results": rows}
  for figure, name in ((plots.levels_figure, "l.png"), (plots.gamma_figure, "g.png")):
    assert figure(record, tmp_path / name)
    assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
  assert not plots.levels_figure({**record, "results": rows[:1]}, tmp_path / "none.png")
  assert not plots.gamma_figure({**record, "results": rows[:2]}, tmp_path / "none.png")  # one stack
  table = tables.level_markdown(rows)
  assert "| triforce | 64 | draft[streaming:16x234] (drafting) | – | – | 30 | 3.0 | 5% |" in table
  assert "| hitree2 | 64 | target[retrieval:1024]/6 -> target | 0.90 | – | 10 | 60.0 | 30% |" in table
  assert tables.level_markdown(rows[:1]) == ""
  assert tables.stack_shape(None) == {}
  from hitree_jax.decode.drafters import NGramDrafter
  from hitree_jax.cache.kinds import Retrieval
  from hitree_jax.decode.stack import Stack, Verifier
  from hitree_jax.tree import shapes as tree_lib
  stack = Stack(NGramDrafter(2), tree_lib.kary(3, 2), (Verifier("target", Retrieval(64), 6),))
  assert tables.stack_shape(stack) == {"tree_depth": 2, "tree_size": 12, "tree_width": 3, "gammas": [6]}


def test_progress_reports_elapsed_and_eta():
  from launch.progress import Progress, duration
  assert [duration(s) for s in (0, 45, 80, 240, 3725)] == ["0s", "45s", "1m20s", "4m00s", "1h02m"]
  now, lines = [100.0], []
  progress = Progress("benchmark", 12, clock=lambda: now[0], log=lambda fmt, line: lines.append(line))
  now[0] += 80
  progress.step(3, "tree/self:8/kary:2x2 P=2048 prompt 1")
  assert lines[-1] == ("benchmark 3/12 (25%) elapsed 1m20s, ETA 4m00s: "
                       "tree/self:8/kary:2x2 P=2048 prompt 1")
  now[0] += 240
  progress.step(9)
  assert lines[-1] == "benchmark 12/12 (100%) elapsed 5m20s"
  # Library loops call back with (done, total, detail); done=0 restarts the clock, and
  # min_interval_s keeps a fast loop to a line now and then (always the last).
  training = Progress("training", min_interval_s=30, clock=lambda: now[0],
                      log=lambda fmt, line: lines.append(line))
  now[0] += 1000
  training.update(0, 100)
  for step in range(1, 101):
    now[0] += 1
    training.update(step, 100, f"step {step}")
  logged = [line for line in lines if line.startswith("training")]
  assert logged[0] == "training 1/100 (1%) elapsed 1s, ETA 1m39s: step 1"
  assert len(logged) == 5 and logged[-1] == "training 100/100 (100%) elapsed 1m40s: step 100"


@pytest.mark.parametrize("args,message", [
    (["--temperature=-1", "--prompt=hi"], "temperature=-1.0"),
    (["--top_p=1.5", "--prompt=hi"], "top_p=1.5"),
    (["--method=beam", "--prompt=hi"], "method 'beam' is not available"),
    (["--method=tree", "--tree=dynamic:60,2", "--prompt=hi"], "budget=60 nodes do not fit"),
    (["--method=tree", "--tree=sequoia:16,4", "--prompt=hi"], "need the draft's acceptance profile"),
    (["--method=sd", "--draft=selfie", "--prompt=hi"], "unknown drafter 'selfie'"),
    (["--model=/no/such/model.gguf", "--prompt=hi"], "/no/such/model.gguf"),
    (["--prompt_file=/no/such/prompt.txt"], "--prompt_file=/no/such/prompt.txt"),
    (["--prompt=a", "--text=austen"], "--text=austen makes a passage of the book the prompt; drop --prompt"),
    (["--prompt=a", "--prompt_file=x.txt"], "give exactly one of --prompt, --prompt_file, --prompts_file, or --text=BOOK"),
    (["--text=chat"], "give exactly one of --prompt, --prompt_file, --prompts_file, or --text=BOOK for a book's passage (got none)"),
    (["--prompts_file=tests/data/not_utf8.txt"], "--prompts_file=tests/data/not_utf8.txt: not UTF-8"),
    (["--prompts_file=tests/data/bad_prompts.jsonl"], 'line 2 is not a JSON object with a "prompt"'),
    (["--prompts_file=tests/data/two_prompts.txt", "--batch_size=0"], "--batch_size=0 must be >= 1"),
    (["--method=auto", "--draft=ngram:3", "--prompt=hi"], "not ngram:3"),
    (["--method=auto", "--draft=drafts/smollm2-draft.gguf", "--gamma=3", "--prompt=hi"],
     "--gamma does not apply to --method=auto"),
    (["--method=auto", "--draft=eagle:drafts/smollm2-eagle", "--prompt=hi"],
     "joins with --feature_draft=eagle:drafts/smollm2-eagle"),
    (["--method=auto", "--draft=drafts/smollm2-draft.gguf", "--feature_draft=medusa:drafts/smollm2-medusa",
      "--prompt=hi"], "--feature_draft=medusa:drafts/smollm2-medusa: the planner weighs an EAGLE draft"),
    (["--method=auto", "--draft=drafts/smollm2-draft.gguf", "--feature_draft=eagle:/no/such", "--prompt=hi"],
     "'/no/such' not found"),
    (["--method=sd", "--feature_draft=eagle:drafts/smollm2-eagle", "--prompt=hi"],
     "--feature_draft does not apply to --method=sd"),
    (["--key_dtype=float16", "--prompt=hi"], "--key_dtype"),
])
def test_generate_rejects_bad_input_by_name(args, message):
  proc = launch("generate", *args, timeout=120)
  assert proc.returncode != 0
  assert message in proc.stderr + proc.stdout


@pytest.mark.slow
def test_auto_without_a_draft_takes_the_models_shipped_one_and_names_what_another_model_needs(tiny_model):
  from hitree_jax import methods, shipped
  assert methods.default_auto_draft("smollm2", "chat") == str(shipped.find("smollm2-draft-chat"))
  assert methods.default_auto_draft("smollm2", "austen") == str(shipped.find("smollm2-draft"))
  proc = launch("generate", f"--model={tiny_model}", "--method=auto", "--prompt=hi", timeout=120)
  assert proc.returncode == 2 and f"none ships for --model={tiny_model}: give --draft=PATH" in proc.stderr


@pytest.mark.slow
def test_generate_decodes_a_file_of_prompts_in_batches_each_row_as_alone(tiny_model, tmp_path):
  """--prompts_file: three chat prompts of different lengths, decoded two at a time with prompt
  lookup; each row's tokens are those of its prompt generated alone (greedy), and each stops at
  its own EOS or length; so are they with the caches sized for longer prompts (--size_caches_for)."""
  prompts = ["Name a colour.", "Write two sentences about the sea, then repeat them.", "Say hello\nin two lines."]
  jsonl = tmp_path / "prompts.jsonl"
  jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
  common = [f"--model={tiny_model}", "--text=chat", "--method=sd", "--draft=ngram", "--gamma=3",
            "--max_new_tokens=12", "--json"]
  proc = launch("generate", f"--prompts_file={jsonl}", "--batch_size=2", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert [b["rows"] for b in record["batches"]] == [2, 1] and len(record["rows"]) == 3
  assert all(f"--- {i} ---" in proc.stdout for i in range(1, 4))
  # Alone: a batch of one row each, and the first also from --prompt.
  alone = launch("generate", f"--prompts_file={jsonl}", "--batch_size=1", *common)
  assert alone.returncode == 0, alone.stderr[-3000:]
  singles = json.loads(alone.stdout.strip().splitlines()[-1])
  assert [b["rows"] for b in singles["batches"]] == [1, 1, 1]
  first = launch("generate", f"--prompt={prompts[0]}", *common)
  assert first.returncode == 0, first.stderr[-3000:]
  assert singles["rows"][0]["tokens"] == json.loads(first.stdout.strip().splitlines()[-1])["tokens"]
  for row, single in zip(record["rows"], singles["rows"], strict=True):
    assert (row["prompt_ids"], row["tokens"]) == (single["prompt_ids"], single["tokens"])
  assert len({len(row["prompt_ids"]) for row in record["rows"]}) > 1
  # A plain text file: one prompt per line.
  text = tmp_path / "prompts.txt"
  text.write_text("\n".join(p.replace("\n", " ") for p in prompts[:2]) + "\n\n")
  proc = launch("generate", f"--prompts_file={text}", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert [b["rows"] for b in json.loads(proc.stdout.strip().splitlines()[-1])["batches"]] == [2]
  # Sized for longer prompts (one program for every batch up to them): the same rows.
  proc = launch("generate", f"--prompts_file={jsonl}", "--batch_size=2", "--size_caches_for=200", *common)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1])["rows"] == record["rows"]
  proc = launch("generate", f"--prompts_file={jsonl}", "--size_caches_for=100000", *common)
  assert proc.returncode == 2 and "caches sized for 100000-token prompts" in proc.stderr


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory):
  """A tiny random GGUF draft whose vocabulary (100 tokens) is not SmolLM2's."""
  import jax
  from hitree_jax.loading.gguf import save_gguf
  from hitree_jax.model.config import ModelConfig
  from hitree_jax.model.llama import init_params
  config = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128)
  path = tmp_path_factory.mktemp("draft") / "foreign.gguf"
  save_gguf(path, config, init_params(config, jax.random.key(0)), quantize=False)
  return path


def test_method_specs_name_a_draft_model_by_path(foreign_draft):
  from hitree_jax.methods import Knobs, parse_method
  method = parse_method(f"sd/{foreign_draft}/3")
  assert method.draft_path == str(foreign_draft) and method.tree.size == 3
  method = parse_method(f"tree/{foreign_draft},iid/kary:2x2")
  assert method.draft_mode == "iid" and method.tree.size == 6
  method = parse_method("sd", Knobs(draft=str(foreign_draft), gamma=2))  # --draft=PATH
  assert method.draft_path == str(foreign_draft) and method.tree.size == 2
  with pytest.raises(FileNotFoundError, match="no/such.gguf"):
    parse_method("sd/no/such.gguf/3")


def test_method_lists_keep_commas_inside_specs():
  from hitree_jax.methods import join_method_specs
  items = "ar,sd/ngram/4,tree/self:4,iid/sequoia:8,4,tree/d.gguf/dynamic:16,5".split(",")
  assert join_method_specs(items) == ["ar", "sd/ngram/4", "tree/self:4,iid/sequoia:8,4",
                                      "tree/d.gguf/dynamic:16,5"]


def test_sequoia_tree_from_an_acceptance_profile(foreign_draft, tmp_path):
  from hitree_jax.tree import shapes as tree_lib
  from hitree_jax.methods import Knobs, parse_method
  method = parse_method("tree/self:4/sequoia:6,3", Knobs(acceptance="0.6,0.2,0.1"))
  assert method.tree == tree_lib.from_acceptance([0.6, 0.2, 0.1], 6, 3)
  assert method.tree.size <= 6 and method.tree.max_depth <= 3
  # A draft model's own evaluation (DRAFT.json, from launch.distill) is the default profile.
  foreign_draft.with_suffix(".json").write_text(json.dumps(
      {"acceptance_profile": [0.9, 0.05], "greedy_acceptance_profile": [0.3, 0.3, 0.3]}))
  try:
    sampled = parse_method(f"tree/{foreign_draft}/sequoia:6,6", greedy=False)
    greedy = parse_method(f"tree/{foreign_draft}/sequoia:6,6", greedy=True)
  finally:
    foreign_draft.with_suffix(".json").unlink()
  assert sampled.tree == tree_lib.from_acceptance([0.9, 0.05], 6, 6) != greedy.tree


def test_generate_refuses_a_draft_with_another_vocabulary(foreign_draft):
  proc = launch("generate", "--method=sd", f"--draft={foreign_draft}", "--prompt=hi", timeout=300)
  assert proc.returncode != 0
  assert "vocabularies differ: the draft's has 100 tokens, the target's 49152" in proc.stderr


def test_reselection_in_presets_and_levels():
  from hitree_jax.cache.kinds import Retrieval
  from hitree_jax.model.config import ModelConfig
  from hitree_jax.methods import Knobs, parse_method
  target = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
  method = parse_method("retrieval/6", Knobs(budget=512, reselect=64))
  assert str(method.levels) == "retrieval:512:64,iid/chain:6"
  assert method.build(target).drafter.cache == Retrieval(512, reselect=64)
  stack = parse_method("hsd/ngram:3/chain:2+retrieval:1024:32/6").build(target)
  assert stack.verifiers[0].cache == Retrieval(1024, reselect=32)
  assert str(stack.verifiers[0]) == "target[retrieval:1024:32]/6"
  assert parse_method("retrieval/6").build(target).drafter.cache == Retrieval(1024)  # never


@pytest.fixture(scope="module")
def smollm2_f32_gguf(tmp_path_factory):
  """SmolLM2 written by launch.convert as an F32 GGUF: the weights our float32 model decodes with."""
  path = tmp_path_factory.mktemp("f32") / "smollm2_f32.gguf"
  proc = launch("convert", "--model=smollm2", f"--out={path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return path


@pytest.mark.slow
def test_convert_writes_the_same_weights_as_an_f32_gguf(smollm2_f32_gguf):
  import jax
  import numpy as np
  from hitree_jax.loading import load_model
  from hitree_jax.tokenizer import load_tokenizer
  from launch import peers
  assert peers.gguf_file_type(smollm2_f32_gguf) == "F32"
  original, converted = load_model("smollm2"), load_model(str(smollm2_f32_gguf))
  assert converted.config == original.config
  for a, b in zip(jax.tree.leaves(original.params), jax.tree.leaves(converted.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = "It is a truth universally acknowledged"
  assert load_tokenizer(smollm2_f32_gguf).encode(text) == load_tokenizer(original.path).encode(text)


@pytest.mark.slow
def test_benchmark_peers_decode_the_same_ids_as_ar(tiny_model, tmp_path):
  """HF transformers (and llama.cpp on the F32 file with its cache in f16 and in f32, where
  llama-cpp-python is installed) decode the same prompt ids greedily: their tokens equal our ar's,
  each timed right after ar on the same prompt; a missing peer and a bad cache type are named.
  The model is the one-layer F32 GGUF with SmolLM2's tokenizer: each peer reads the file itself
  (transformers' GGUF loader, llama.cpp), which is what is tested; SmolLM2's own logits are
  checked against transformers in tests/test_smollm2.py."""
  import importlib.util
  has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
  out = tmp_path / "peers.json"
  peer_list = "hf,llamacpp" if has_llamacpp else "hf"
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=ar", f"--peers={peer_list}",
                f"--llamacpp_gguf={tiny_model}", "--llamacpp_cache=f16,f32", "--prompt_tokens=40",
                "--max_new_tokens=8",
                "--n_prompts=2", "--time_levels=false", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
  assert set(rows) == {"ar", "hf"} | ({"llama.cpp F32", "llama.cpp F32, f32 cache"} if has_llamacpp else set())
  ar_order = [run["order"] for run in rows["ar"]["runs"]]
  for name, row in rows.items():
    assert row["median_decode_tokens_per_s"] > 0 and row["median_prefill_s"] > 0
    if name != "ar":
      assert row["peer"] and [run["same_tokens_as_ar"] for run in row["runs"]] == [8, 8], (name, row["runs"])
      # timed in turn: ar on prompt 0, the peers on it, ar on prompt 1, the peers on it
      assert ar_order[0] < row["runs"][0]["order"] < ar_order[1] < row["runs"][1]["order"], (name, row["runs"])
  assert "| hf | 40 |" in (tmp_path / "peers.md").read_text()
  # Without ar among the methods the peers run after them, with no ar tokens to compare.
  proc = launch("benchmark", f"--model={tiny_model}", "--methods=sd/ngram/4", "--peers=hf", "--prompt_tokens=40",
                "--max_new_tokens=4", "--n_prompts=1", "--time_levels=false", f"--out={tmp_path / 'w.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "w.json").read_text())["results"]
  assert [r["method"] for r in rows] == ["sd/ngram/4", "hf"]
  assert rows[0]["runs"][0]["order"] < rows[1]["runs"][0]["order"] and "same_tokens_as_ar" not in rows[1]["runs"][0]
  if not has_llamacpp:
    proc = launch("benchmark", f"--model={tiny_model}", "--peers=llamacpp", f"--out={tmp_path / 'x.json'}")
    assert proc.returncode == 2 and "pip install llama-cpp-python" in proc.stderr
  proc = launch("benchmark", f"--model={tiny_model}", "--peers=vllm", f"--out={tmp_path / 'y.json'}")
  assert proc.returncode == 2 and "unknown peer 'vllm'" in proc.stderr
  proc = launch("benchmark", f"--model={tiny_model}", "--llamacpp_cache=q8_0", f"--out={tmp_path / 'z.json'}")
  assert proc.returncode == 2 and "--llamacpp_cache=q8_0: expected f16 and/or f32" in proc.stderr


def test_xla_profile_gives_each_product_its_role():
  import jax
  import jax.numpy as jnp
  from launch import xla_profile

  @jax.jit
  def forward(params, cache, x):
    h = jnp.tanh(x @ params["proj"]["kernel"])                    # weights: 8 x 16 floats
    scores = jnp.einsum("bd,bsd->bs", h, cache)                     # attention: reads no parameter
    return (h + scores @ cache) @ params["lm_head"]["kernel"]      # attention, then the head
  params = {"proj": {"kernel": jnp.ones((8, 16))}, "lm_head": {"kernel": jnp.ones((16, 32))}}
  args = (params, jnp.ones((2, 5, 16)), jnp.ones((2, 8)))
  roles = xla_profile.op_roles(forward.lower(*args).compile().as_text())
  products = sorted(role for role, _ in roles.values() if role != "other")
  assert products == ["attention", "attention", "head", "weights"]
  assert sorted(n for role, n in roles.values() if role in ("weights", "head")) == [8 * 16 * 4, 16 * 32 * 4]
  # ops that overlap share the stretch: the shares add up to the time covered (25), not to 30
  spans = [(0, 10, ("weights", 0)), (5, 15, ("attention", 0)), (20, 25, ("other", 0)), (7, 7, ("head", 0))]
  assert xla_profile.shared_time(spans) == {"weights": 7.5, "attention": 7.5, "other": 5}
  result = xla_profile.breakdown(forward, *args, repeats=3)
  assert result["weights_ms"] > 0 and result["head_ms"] > 0 and result["attention_ms"] > 0
  assert result["ops"] >= 4 and result["weights_gb_per_s"] > 0


@pytest.mark.slow
def test_step_cost_splits_a_step_into_its_parts(tmp_path):
  """On a 4-layer random model with SmolLM2's tokenizer: the split and the profiler's roles do not
  depend on the model's size (docs/results has SmolLM2's)."""
  from tests.helpers import tiny_model_gguf
  layers = 4
  model = tiny_model_gguf(tmp_path / "tiny.gguf", num_layers=layers)
  out = tmp_path / "cost.json"
  proc = launch("step_cost", f"--model={model}", "--prompt_tokens=40", "--widths=1,3", "--repeats=2",
                "--step_tokens=6", "--temperature=0.6", "--top_p=0.9", "--xla_profile", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert row["prompt_tokens"] == 40 and row["step_ms"] > 0
  one, three = row["widths"]["1"], row["widths"]["3"]
  for part in (one, three):
    # Each part is timed on its own, so their order is left to noise (a 40-token context's attention
    # is smaller than the jitter of a loaded machine): the test checks the split, not which part is larger.
    assert min(part[f"{name}_ms"] for name in ("forward", "layers", "head", "sampling")) > 0
    assert part["attention_ms"] == pytest.approx(part["forward_ms"] - part["layers_ms"] - part["head_ms"])
  assert three["verify_ms"] > 0 and "verify_ms" not in one
  for part in (one, three):  # by the profiler: 4 layers of 7 projections, an attention per layer
    profile = part["profile"]
    assert min(profile[f"{role}_ms"] for role in ("weights", "head", "attention", "other")) > 0
    assert profile["ops"] > layers * 9 and profile["weights_gb_per_s"] > 0 and profile["head_gb_per_s"] > 0
    roles = sum(profile[f"{role}_ms"] for role in ("weights", "head", "attention", "other", "runtime"))
    assert roles == pytest.approx(part["forward_ms"])   # the forward column, split
  assert row["loop_ms"] == pytest.approx(row["step_ms"] - one["forward_ms"] - one["sampling_ms"])
  table = (tmp_path / "cost.md").read_text()
  assert table.startswith("| prompt tokens | `ar` step ms |") and "| 40 | 3 |" in table
  assert "By XLA's profiler" in table
  proc = launch("step_cost", f"--model={model}", "--widths=0", f"--out={out}")
  assert proc.returncode == 2 and "--widths" in proc.stderr


@pytest.mark.slow
def test_benchmark_runs_spec_bench_and_checks_every_turn_against_ar(tiny_model, tmp_path):
  """Spec-Bench's protocol (on a one-layer model with SmolLM2-Instruct's tokenizer and template,
  and SmolLM2's distilled draft): chat template, EOS honoured, MT-bench's second
  turn after the model's own first answer, per-task speedup and τ, and exactness per turn; with
  --methods=auto, the planner's stack for the questions' typical length and each batch size
  (stored profiles, made up here: measuring SmolLM2's takes minutes; at batch 2, one where
  nothing beats `ar`)."""
  import os
  from hitree_jax.decode.sampling import SamplingParams
  from hitree_jax.loading import resolve
  from hitree_jax.planner import auto
  from tests.helpers import planned_label, synthetic_profile
  draft = "drafts/smollm2-draft.gguf"
  # Chat questions of about 80 tokens are planned from a chat profile at 128.
  key = (str(tiny_model), str(resolve(draft)), 128, SamplingParams.create())
  stored = auto.profile_path(tmp_path / "profiles", *key, "chat")
  stored.parent.mkdir(parents=True)
  stored.write_text(json.dumps({"key": auto.profile_key(*key, "chat", None), "profile": synthetic_profile(128)}))
  auto.profile_path(tmp_path / "profiles", *key, "chat", batch=2).write_text(json.dumps(
      {"key": auto.profile_key(*key, "chat", None, batch=2), "profile": dict(synthetic_profile(128), ar_seconds=1e-4)}))
  chosen = auto.choose(synthetic_profile(128), True)
  out = tmp_path / "sb.json"
  proc = launch("benchmark", f"--model={tiny_model}", "--text=chat", "--categories=mt_bench,qa", "--per_category=1",
                "--methods=ar,sd/ngram/4,auto", f"--draft={draft}", "--max_new_tokens=16", f"--out={out}",
                "--batch_sizes=1,2",
                env=dict(os.environ, HITREE_PROFILES=str(tmp_path / "profiles")))
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(out.read_text())
  assert record["text"] == "chat" and record["questions"] == "specbench" and record["tasks"] == {"mt_bench": 1, "qa": 1}
  results = {r["method"]: r for r in record["results"] if r["batch_size"] == 1}
  planned = next(m for m in results if m.startswith("auto="))
  label, _, note = planned.partition(" (planned for ")
  assert label.startswith("auto=hsd/") and label.endswith(planned_label(chosen, draft)) and note.endswith("prompt tokens)")
  assert set(results) == {"ar", "sd/ngram/4", planned}
  assert results["sd/ngram/4"]["differs_from_ar"] == results[planned]["differs_from_ar"] == []
  for r in results.values():
    assert set(r["tasks"]) == {"mt_bench", "qa"} and r["overall"]["turns"] == 3
    assert r["overall"]["tau"] >= 1 and r["tasks"]["qa"]["speedup"] > 0
  assert results["ar"]["overall"]["speedup"] == 1.0 and results["ar"]["overall"]["tau"] == 1.0
  # Two questions at a time: each row is what its question gives alone (`ar` at batch 1), and
  # the second batch is MT-bench's second turn alone.
  paired = {r["method"]: r for r in record["results"] if r["batch_size"] == 2}
  assert set(paired) == {"ar", "sd/ngram/4", f"auto=ar (planned for {note}"}   # batch 2's own profile
  assert record["batch_sizes"] == [1, 2]
  assert all(r["differs_from_ar"] == [] for r in paired.values())
  assert paired["ar"]["overall"]["new_tokens"] == results["ar"]["overall"]["new_tokens"]
  runs = {(r["method"], r["batch_size"]): r["questions"] for r in record["runs"]}
  assert [t["rows"] for q in runs["ar", 2] for t in q["turns"]] == [2, 1, 2]
  first, second = runs["ar", 1][0]["turns"]   # MT-bench question 81: two turns
  assert runs["ar", 1][0]["question_id"] == 81
  # the second turn's prompt holds the first turn's prompt and the model's answer to it
  assert second["prompt_tokens"] > first["prompt_tokens"] + first["new_tokens"]
  assert all(t["new_tokens"] <= 16 for run in runs["ar", 1] for t in run["turns"])
  table = (tmp_path / "sb.md").read_text()
  assert "| sd/ngram/4 | 1 |" in table and "| sd/ngram/4 | 2 |" in table and "| yes |" in table
  assert (tmp_path / "sb_specbench.png").exists()

  mine = tmp_path / "mine.jsonl"
  mine.write_text(json.dumps({"question_id": 7, "category": "chat", "turns": ["Name a colour."]}) + "\n")
  proc = launch("benchmark", "--text=chat", f"--questions={mine}", "--methods=ar", "--max_new_tokens=4", f"--out={tmp_path / 'm.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads((tmp_path / "m.json").read_text())["questions"] == str(mine)
  assert json.loads((tmp_path / "m.json").read_text())["tasks"] == {"chat": 1}
  proc = launch("benchmark", f"--questions={mine}", f"--out={tmp_path / 'q.json'}")   # book passages by default
  assert proc.returncode == 2 and "--questions applies to --text=chat, not to --text=austen's passages" in proc.stderr
  proc = launch("benchmark", "--text=chat", "--prompt_tokens=512", f"--out={tmp_path / 'x.json'}")
  assert proc.returncode == 2 and "--prompt_tokens applies to book passages" in proc.stderr
  proc = launch("benchmark", "--text=chat", "--batch_sizes=4,0", f"--out={tmp_path / 'z.json'}")
  assert proc.returncode == 2 and "--batch_sizes=4,0: give at least one, each at least 1" in proc.stderr
  proc = launch("benchmark", "--text=chat", "--categories=poetry", f"--out={tmp_path / 'y.json'}")
  assert proc.returncode == 2 and "--categories: poetry not among" in proc.stderr


def test_a_record_names_the_command_that_made_it(tmp_path):
  """provenance.stamp() carries the command line: a launcher's as `python -m MODULE ARGS` (quoted
  where a shell needs it), a script's by its path; `python -c` has none to give (its caller's)."""
  import subprocess
  import sys
  from tests.helpers import REPO
  script = tmp_path / "measure.py"
  script.write_text("from hitree_jax import provenance\nprint(provenance.command())\n")
  ran = lambda *args: subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                                     check=True).stdout.strip()
  assert ran(str(script), "--out=a b.json") == f"{script} '--out=a b.json'"
  assert ran("-c", "from hitree_jax import provenance; print(provenance.command())") == "None"
