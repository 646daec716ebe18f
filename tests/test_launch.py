"""The absl launchers end to end, as a user runs them (subprocesses, real SmolLM2)."""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def launch(module, *args, timeout=600):
  return subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def test_generate_json_record():
  proc = launch("generate", "--model=smollm2", "--book=austen", "--prompt_tokens=64",
                "--max_new_tokens=6", "--ignore_eos", "--temperature=0.6", "--top_p=0.9", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  for key in ("prompt_ids", "tokens", "text", "prefill_s", "decode_s", "decode_tokens_per_s", "compile_s"):
    assert key in record, key
  assert len(record["prompt_ids"]) == 64 and len(record["tokens"]) == 6
  assert record["compile_s"] > 0 and record["decode_tokens_per_s"] > 0


def test_benchmark_writes_json_and_table(tmp_path):
  out = tmp_path / "bench.json"
  proc = launch("benchmark", "--model=smollm2", "--methods=ar", "--prompt_tokens=32,48",
                "--new_tokens=4", "--n_prompts=2", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(out.read_text())
  assert [r["prompt_tokens"] for r in record["results"]] == [32, 48]
  for row in record["results"]:
    assert len(row["runs"]) == 2 and row["median_decode_tokens_per_s"] > 0
    assert all(run["new_tokens"] == 4 and run["compiles"] == 0 for run in row["runs"])
  assert "| ar | 32 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("args,message", [
    (["--temperature=-1", "--prompt=hi"], "temperature=-1.0"),
    (["--top_p=1.5", "--prompt=hi"], "top_p=1.5"),
    (["--method=beam", "--prompt=hi"], "method 'beam' is not available"),
    (["--method=tree", "--tree=sequoia:16,4", "--prompt=hi"], "sequoia trees are not supported yet"),
    (["--method=sd", "--draft=selfie", "--prompt=hi"], "bad draft spec 'selfie'"),
    (["--model=/no/such/model.gguf", "--prompt=hi"], "/no/such/model.gguf"),
    (["--prompt_file=/no/such/prompt.txt"], "--prompt_file=/no/such/prompt.txt"),
    (["--prompt=a", "--book=austen"], "exactly one of --prompt, --prompt_file, --book"),
])
def test_generate_rejects_bad_input_by_name(args, message):
  proc = launch("generate", *args, timeout=120)
  assert proc.returncode != 0
  assert message in proc.stderr + proc.stdout
