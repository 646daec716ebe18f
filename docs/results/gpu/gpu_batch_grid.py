"""The batch grid on a GPU (not part of the library): `ar`, prompt lookup and the chat EAGLE tree
on 64 Spec-Bench questions (16 each of mt_bench, translation, qa and math_reasoning; 80 turns),
greedy, float32, 128 new tokens at most, at batch 64, 16, 4 and 1, within SECONDS in all.

  python docs/results/gpu/gpu_batch_grid.py MODEL.gguf OUT_DIR SECONDS

A GPU takes 16-22 s to compile each decode program (docs/accelerators.md), and Spec-Bench's
prompt lengths spread over several cache buckets and prefill chunks: the first try spent seven
minutes compiling and wrote nothing. So here
- every run uses one cache size (SLOTS) and one prefill chunk (CHUNK): a method compiles one
  decode program per batch shape, not one per bucket. On this GPU a SmolLM2 step costs about the
  same over 2K or 8K slots (gpu_level_cost_smollm2_h100.md), so the larger cache costs little.
  (The launchers' --size_caches_for does this now; the script sets the sizes itself, as it did
  for its record, gpu_batch_grid_h200.md);
- first, one process per batch size compiles at once (16 cores), each asking just enough
  questions to build every program its timed run needs, into the persistent compilation cache;
- then one process per batch size in turn times all 64 questions, its programs read from there.
OUT_DIR gets grid_B.json (launch.benchmark's record, copied after each batch size, and also
when a run is cut short: the benchmark writes it after each method) and grid_log.json.

  python docs/results/gpu/gpu_batch_grid.py --benchmark BENCHMARK_FLAGS...
runs launch.benchmark with those sizes set (what each process above runs).
"""
import json, os, runpy, shutil, subprocess, sys, tempfile, time

METHODS = "ar,sd/ngram/8,tree/eagle:smollm2-eagle-chat/dynamic:10,4"
SLOTS = 1024      # Spec-Bench's turns here: at most about 300 prompt tokens, + 128 new + a recent cache
CHUNK = 256       # one prefill chunk for a first turn, two for a second
ORDER = [(64, 0.25), (16, 0.3), (4, 0.45), (1, 1.0)]   # (batch, share of the seconds left); 1 runs longest
COMPILE_SHARE = 0.45   # of SECONDS at most for the compiling processes
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def benchmark_with_fixed_sizes(argv: list[str]) -> None:
  sys.path.insert(0, ROOT)
  from hitree_jax.decode import prefill
  prefill.CACHE_BUCKET = SLOTS
  prefill.prefill_chunk_size = lambda prompt_len: CHUNK
  sys.argv = ["launch.benchmark", *argv]
  runpy.run_module("launch.benchmark", run_name="__main__", alter_sys=True)


def command(model: str, batch: int, per_category: int, out: str) -> list[str]:
  return [sys.executable, os.path.abspath(__file__), "--benchmark", f"--model={model}", "--text=chat",
          "--categories=mt_bench,translation,qa,math_reasoning", f"--per_category={per_category}",
          f"--methods={METHODS}", f"--batch_sizes={batch}", "--dtype=float32", "--max_new_tokens=128",
          "--temperature=0", f"--out={out}"]


def main(model: str, out_dir: str, seconds: float) -> None:
  deadline = time.time() + seconds
  os.makedirs(out_dir, exist_ok=True)
  scratch = tempfile.mkdtemp()
  env = dict(os.environ, PYTHONUNBUFFERED="1", HITREE_HUGE_PAGES="off",
             XLA_PYTHON_CLIENT_MEM_FRACTION="0.2")   # four processes share the GPU while compiling
  log = {"methods": METHODS, "slots": SLOTS, "chunk": CHUNK, "compile": [], "runs": []}

  def save_log():
    with open(os.path.join(out_dir, "grid_log.json"), "w") as f:
      json.dump(log, f, indent=2)

  # Phase 1: each batch size's programs, compiled at once. A batch of B asks the first B
  # questions, so the shapes are the timed run's: B rows, and its second turns' rows.
  start = time.time()
  procs = {b: subprocess.Popen(command(model, b, max(1, b // 4), os.path.join(scratch, f"warm_{b}.json")),
                               env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for b, _ in ORDER}
  for b, proc in procs.items():
    try:
      output, _ = proc.communicate(timeout=max(1.0, start + COMPILE_SHARE * seconds - time.time()))
    except subprocess.TimeoutExpired:
      proc.kill()
      output, _ = proc.communicate()
    log["compile"].append({"batch": b, "rc": proc.returncode, "seconds": time.time() - start,
                           "output": output[-2500:]})
    print(f"compiled batch {b}: rc {proc.returncode} at {time.time() - start:.0f} s", flush=True)
  save_log()

  # Phase 2: timed, one batch size at a time.
  for batch, share in ORDER:
    left = deadline - time.time()
    if left < 20:
      break
    out = os.path.join(scratch, f"grid_{batch}.json")
    begin = time.time()
    try:
      proc = subprocess.run(command(model, batch, 16, out), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=left * share)
      rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
      rc, output = "timeout", e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    if os.path.exists(out):
      shutil.copy(out, os.path.join(out_dir, f"grid_{batch}.json"))
    log["runs"].append({"batch": batch, "rc": rc, "seconds": time.time() - begin, "output": output[-4000:]})
    print(f"batch {batch}: rc {rc} in {time.time() - begin:.0f} s\n{output[-1200:]}", flush=True)
    save_log()


if __name__ == "__main__":
  if sys.argv[1] == "--benchmark":
    benchmark_with_fixed_sizes(sys.argv[2:])
  else:
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
