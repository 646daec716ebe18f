"""The batch grid on a GPU (not part of the library): `ar`, prompt lookup and the chat EAGLE tree
on 64 Spec-Bench questions (16 each of mt_bench, translation, qa and math_reasoning; 80 turns),
greedy, 128 new tokens at most, at batch 16, 64, 4 and 1 in that order, each batch size a
`launch.benchmark` process of its own that writes OUT_DIR/grid_B.json, within SECONDS in all.
With STEP.json (docs/results/gpu/gpu_step_flags.py's record) it runs under the XLA_FLAGS of the
fastest float32 batch-1 `ar` step there, and with autotuning off when that step is within 3%
of the same flags' step with autotuning on (autotuning compiles each new shape for seconds).

  python docs/results/gpu/gpu_batch_grid.py MODEL.gguf OUT_DIR SECONDS [STEP.json]
"""
import json, os, subprocess, sys, time

METHODS = "ar,sd/ngram/8,tree/eagle:smollm2-eagle-chat/dynamic:10,4"
ORDER = [(16, 0.3), (64, 0.4), (4, 0.5), (1, 1.0)]   # (batch, share of the seconds left)


def chosen_flags(step_record: str | None) -> str:
  if not step_record:
    return ""
  runs = [r for r in json.load(open(step_record))["runs"]
          if "error" not in r and r["dtype"] == "float32" and r["batch"] == 1]
  best = min(runs, key=lambda r: r["ms_per_step"])
  flags = best["xla_flags"]
  untuned = next((r for r in runs if r["variant"] == "autotuning off"), None)
  tuned = next((r for r in runs if r["variant"] == "defaults"), None)
  if untuned and tuned and untuned["ms_per_step"] <= 1.03 * tuned["ms_per_step"]:
    flags += " --xla_gpu_autotune_level=0"
  return flags.strip()


def main(model: str, out_dir: str, seconds: float, step_record: str | None = None) -> None:
  deadline = time.time() + seconds
  flags = chosen_flags(step_record)
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(),
             PYTHONUNBUFFERED="1")
  print(f"XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
  log = {"xla_flags": env["XLA_FLAGS"], "methods": METHODS, "runs": []}
  for batch, share in ORDER:
    left = deadline - time.time()
    if left < 30:
      break
    start = time.time()
    out = os.path.join(out_dir, f"grid_{batch}.json")
    proc = subprocess.run(
        ["timeout", str(int(left * share)), sys.executable, "-m", "launch.benchmark", f"--model={model}",
         "--text=chat", "--categories=mt_bench,translation,qa,math_reasoning",
         "--per_category=16", f"--methods={METHODS}", f"--batch_sizes={batch}", "--dtype=float32",
         "--max_new_tokens=128", "--temperature=0", f"--out={out}"], env=env, capture_output=True, text=True)
    log["runs"].append({"batch": batch, "rc": proc.returncode, "seconds": time.time() - start,
                        "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-3000:]})
    print(f"batch {batch}: rc {proc.returncode} in {time.time() - start:.0f} s\n{proc.stdout[-1500:]}", flush=True)
    with open(os.path.join(out_dir, "grid_log.json"), "w") as f:
      json.dump(log, f, indent=2)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
