"""The distillation launcher end to end: a draft model and EAGLE-3 chat heads trained, exported,
evaluated and decoded with (apart from tests/test_launch.py so that pytest-xdist can run these
long tests beside the rest of the launchers'). The teacher is a 4-layer random model (256 wide) with
SmolLM2's tokenizer and chat template: what is checked here is the launcher's path (labels,
vocabulary, training, export, evaluation, decoding), which does not depend on the teacher's size;
SmolLM2's own trained drafts are checked in tests/test_smollm2.py."""

import json
import time

import pytest

from tests.helpers import launch, tiny_model_gguf


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  # wide enough that a forward costs more than the calls around it: a draft's measured cost ratio
  # (under 1) is the draft's, not the timer's
  return tiny_model_gguf(tmp_path_factory.mktemp("teacher") / "teacher.gguf", num_layers=4, width=256)


def test_distill_checks_sampling_flags_before_any_slow_work(tmp_path):
  tic = time.perf_counter()
  proc = launch("distill", "--temperature=-1", f"--workdir={tmp_path / 'work'}", timeout=120)
  assert proc.returncode != 0 and "temperature=-1" in proc.stderr + proc.stdout
  assert time.perf_counter() - tic < 30  # the teacher would take longer to load, labels hours
  assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_distill_trains_exports_and_evaluates_a_draft(teacher, tmp_path):
  out = tmp_path / "work" / "draft.gguf"   # without --out the export goes under the workdir
  proc = launch("distill", f"--teacher={teacher}", f"--workdir={tmp_path / 'work'}",
                "--layers=0", "--vocab_size=512", "--window=32", "--train_windows=4",
                "--eval_windows=1", "--steps=2", "--batch=2", "--cost_context=32", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert [h["step"] for h in record["history"]] == [2]
  assert out.is_file() and json.loads(out.with_suffix(".json").read_text())["vocab_size"] == 512
  assert 0 <= record["greedy_agreement"] <= 1 and 0 < record["cost_ratio"] < 1
  assert len(record["acceptance_profile"]) == 8
  for line in ("labelling train windows 1/1 (100%)", "labelling eval windows 1/1 (100%)",
               "training 1/2 (50%) elapsed", "training 2/2 (100%)"):
    assert line in proc.stderr, line
  assert json.loads(out.with_suffix(".json").read_text())["draft_contents"] and not list(out.parent.glob(".*partial*"))
  # the same workdir with another teacher: refused before anything loads, naming what differs
  tic = time.perf_counter()
  proc = launch("distill", "--teacher=smollm2", f"--workdir={tmp_path / 'work'}", "--layers=0", "--vocab_size=512",
                "--window=32", "--train_windows=4", "--eval_windows=1", "--steps=2", "--batch=2", "--cost_context=32")
  assert proc.returncode != 0 and "holds a run made with other settings (teacher: " in proc.stderr, proc.stderr[-2000:]
  assert "teacher_contents: " in proc.stderr and time.perf_counter() - tic < 60


@pytest.mark.slow
def test_distill_refuses_bad_taps(tmp_path):
  for args, message in ((["--kind=medusa", "--taps=2"], "--taps=2 is for --kind=eagle"),
                        (["--kind=eagle", "--taps=2,29"], "--taps=2,29: expected teacher layers in 0..28"),
                        (["--kind=eagle", "--taps=15,2"], "expected distinct layers in increasing order")):
    proc = launch("distill", *args, f"--workdir={tmp_path / 'work'}", timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-2000:])
  assert not (tmp_path / "work").exists()


# One EAGLE distillation checks both what a chat recipe and what taps change (they were two launcher
# runs of about 3 minutes each). Medusa: the same launcher path (test_heads_training); EAGLE
# without taps: the shipped draft's tests.
@pytest.mark.slow
def test_distill_trains_eagle3_chat_heads_that_generate_like_ar(teacher, tmp_path):
  """launch.distill --kind=eagle writes a folder that --draft=eagle:PATH decodes with, here an
  EAGLE-3 one (--taps: it reads three of the target's layers beside its final states) trained
  with --text=chat: the teacher answers instructions over book passages, in the chat
  template; the draft trains on those answers and is evaluated on held-out ones, and its
  vocabulary is that text's (the chat template's tokens, which the books' most frequent 511 lack)."""
  import numpy as np
  from hitree_jax.heads import saved
  from hitree_jax.loading import load_model
  out, work = tmp_path / "eagle_chat", tmp_path / "work"
  proc = launch("distill", "--config=configs/distill_eagle_chat.py", "--kind=eagle", f"--teacher={teacher}",
                f"--workdir={work}", f"--out={out}", "--vocab_size=512", "--window=80", "--train_windows=4",
                "--num_heads=2", "--eval_windows=1", "--steps=2", "--batch=2", "--cost_context=32",
                "--own_prompt_tokens=64", "--taps=0,1,2", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  meta = json.loads((out / "heads.json").read_text())
  assert meta["kind"] == "eagle" and meta["vocab_size"] == 512 and "--kind=eagle" in meta["command"]
  assert meta["taps"] == [0, 1, 2] and "--taps=0,1,2" in meta["command"]
  assert 0 <= record["greedy_agreement"] <= 1 and 0 < record["cost_ratio"] < 1
  assert meta["evaluation"]["greedy_agreement"] == record["greedy_agreement"]
  # the recipe, then what overrode it
  assert meta["command"].startswith("python -m launch.distill --config=configs/distill_eagle_chat.py --batch=2 ")
  for split, n in (("train", 4), ("eval", 1)):   # both splits are chat windows, answered by the teacher
    (text,) = work.glob(f"labels_*_{split}_{n}x80_chat64_t0.6_p0.9_text.npy")
    answers = np.load(text)
    assert answers.shape == (n, 80) and answers[:, 64:].any()
  # --eval judges a draft on the same held-out chat windows (the labels are kept): the figure the run wrote
  proc = launch("distill", "--config=configs/distill_eagle_chat.py", "--eval", f"--draft=eagle:{out}",
                f"--teacher={teacher}", f"--workdir={work}", "--window=80", "--eval_windows=1", "--cost_context=32",
                "--own_prompt_tokens=64", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  evaluated = json.loads(proc.stdout.strip().splitlines()[-1])
  assert evaluated["greedy_agreement"] == meta["evaluation"]["greedy_agreement"]
  from hitree_jax.model.vocab import ReducedVocab
  from hitree_jax.tokenizer import chat_prompt, load_tokenizer
  from hitree_jax.train import corpus
  target = load_model(str(teacher))
  _, _, vocab = saved.load(str(out), target.params, target.config, "eagle")
  template = set(chat_prompt(load_tokenizer(target.path), ""))
  books = ReducedVocab.most_frequent(corpus.token_counts(load_tokenizer(target.path), 49152), 512)
  assert template <= set(vocab.target_ids.tolist()) and not template <= set(books.target_ids.tolist())
  # it decodes: its chain gives ar's tokens (the benchmark compares them, and exits 1 if not)
  proc = launch("benchmark", f"--model={teacher}", "--methods=ar,sd", f"--draft=eagle:{out}", "--gamma=2", "--text=austen",
                "--prompt_tokens=64", "--max_new_tokens=12", "--n_prompts=1", "--time_levels=false",
                f"--out={tmp_path / 'bench.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (sd,) = [r for r in json.loads((tmp_path / "bench.json").read_text())["results"] if r["method"] != "ar"]
  assert sd["method"].startswith("sd/eagle:") and sd["differs_from_ar"] == []
  proc = launch("generate", f"--model={teacher}", "--method=sd", f"--draft=eagle:{tmp_path / 'none'}",
                "--prompt=hi")
  assert proc.returncode != 0 and "expected a folder with heads.json" in proc.stderr


@pytest.mark.slow
def test_distill_trains_an_eagle3_draft_in_the_speculators_format(teacher, tmp_path):
  """--kind=eagle3 trains EAGLE-3's architecture along chains and writes a speculators folder
  (config.json, model.safetensors) with heads.json beside it; --eval reads it as it reads a
  downloaded EAGLE-3 draft (eagle3:PATH), per depth of the chain; its chain decodes ar's tokens.
  Too shallow a teacher for EAGLE-3's default layers is refused before anything loads."""
  from hitree_jax.heads import saved
  out, work = tmp_path / "eagle3", tmp_path / "work"
  proc = launch("distill", "--kind=eagle3", f"--teacher={teacher}", f"--workdir={work}", timeout=120)
  assert proc.returncode != 0 and "--kind=eagle3" in proc.stderr and "(2, 2, 1) for a 4-layer" in proc.stderr
  args = [f"--teacher={teacher}", f"--workdir={work}", "--vocab_size=512", "--window=32", "--eval_windows=1",
          "--cost_context=32", "--json"]
  proc = launch("distill", "--kind=eagle3", f"--out={out}", "--taps=0,1,2", "--train_windows=4", "--steps=2",
                "--batch=2", "--ttt_steps=2", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  config = json.loads((out / "config.json").read_text())
  assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
  assert config["draft_vocab_size"] == 511 and (out / "model.safetensors").is_file()   # OTHER is not a token
  meta = json.loads((out / "heads.json").read_text())
  assert meta["format"] == "speculators" and "--kind=eagle3" in meta["command"] and "--ttt_steps=2" in meta["command"]
  # Its cost is recorded, not compared: a one-layer draft reading three taps, timed beside a 4-layer
  # tiny teacher on a loaded machine, ran 1.39x the teacher's step once (dispatch, not arithmetic).
  assert len(record["greedy_agreement_per_depth"]) == 3
  assert record["cost_ratio"] > 0
  assert record["cost_ratio"] == pytest.approx(record["draft_ms_per_token"] / record["target_ms_per_token"])
  assert meta["evaluation"]["greedy_agreement"] == record["greedy_agreement"]
  assert saved.read_meta(str(out), "eagle3")["aux_layers"] == [1, 2, 3]
  evaluates_and_decodes_like_ar(f"eagle3:{out}", args, record, teacher, tmp_path, gamma=2)


@pytest.mark.slow
def test_distill_trains_a_dflash_draft_in_the_speculators_format(teacher, tmp_path):
  """--kind=dflash trains a block drafter at random anchors and writes a speculators folder with
  heads.json beside it; --eval reads it as dflash:PATH (per row of the block, and the rows a greedy
  chain accepts); its block decodes ar's tokens. Bad block settings are refused before any load."""
  from hitree_jax.heads import saved
  out, work = tmp_path / "dflash", tmp_path / "work"
  for args, message in ((["--draft_layers=2"], "(1, 1): not distinct; name the ones to read with --taps"),
                        (["--taps=0,2", "--anchors=30"], "--anchors=30: a window of 32 tokens holds 1 .. 29 blocks of 4"),
                        (["--taps=0,2", "--mask_token_id=49152"], "--mask_token_id=49152: expected a teacher id"),
                        (["--taps=0,2", "--block_size=1"], "--block_size=1 must be >= 2")):
    proc = launch("distill", "--kind=dflash", f"--teacher={teacher}", f"--workdir={work}", "--window=32",
                  "--block_size=4", "--anchors=8", *args, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-2000:])
  args = [f"--teacher={teacher}", f"--workdir={work}", "--window=32", "--eval_windows=1", "--cost_context=32", "--json"]
  proc = launch("distill", "--kind=dflash", f"--out={out}", "--taps=0,2", "--draft_layers=1", "--block_size=4",
                "--anchors=8", "--train_windows=4", "--steps=2", "--batch=2", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  config = json.loads((out / "config.json").read_text())
  assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 3]
  assert config["block_size"] == 4 and config["mask_token_id"] == 49151
  meta = json.loads((out / "heads.json").read_text())
  assert meta["format"] == "speculators" and "--kind=dflash" in meta["command"] and "--anchors=8" in meta["command"]
  assert len(record["greedy_agreement_per_depth"]) == 3 and 0 <= record["greedy_block_accepted"] <= 3
  assert meta["evaluation"]["greedy_agreement"] == record["greedy_agreement"]
  assert saved.read_meta(str(out), "dflash")["target_layer_ids"] == [0, 2]
  evaluates_and_decodes_like_ar(f"dflash:{out}", args, record, teacher, tmp_path, gamma=3)


def evaluates_and_decodes_like_ar(draft: str, args, record: dict, teacher, tmp_path, gamma: int) -> None:
  """`--eval --draft=KIND:PATH` gives the figure training recorded, and a chain of `gamma` of it in
  launch.benchmark gives ar's tokens (the benchmark compares them)."""
  proc = launch("distill", "--eval", f"--draft={draft}", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1])["greedy_agreement"] == record["greedy_agreement"]
  proc = launch("benchmark", f"--model={teacher}", "--methods=ar,sd", f"--draft={draft}", f"--gamma={gamma}",
                "--text=austen", "--prompt_tokens=64", "--max_new_tokens=12", "--n_prompts=1", "--time_levels=false",
                f"--out={tmp_path / 'bench.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (sd,) = [r for r in json.loads((tmp_path / "bench.json").read_text())["results"] if r["method"] != "ar"]
  assert sd["method"].startswith(f"sd/{draft.split(':')[0]}:") and sd["differs_from_ar"] == []

