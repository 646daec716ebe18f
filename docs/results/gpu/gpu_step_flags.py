"""The experiment behind docs/accelerators.md's "An `ar` step's overhead on a GPU" (not part of
the library).

`ar`'s real decode loop (engine.generate with no stack) for SmolLM2-135M's shapes with random
weights, under several XLA_FLAGS, each in a process of its own (XLA reads its flags once):
XLA's defaults, CUDA-graph command buffers that also take the loop's while and conditional
bodies, command buffers for graphs of any size, command buffers off, and autotuning off. Per setting and dtype: ms per decode step at batch 1 and 16
(the median of 3 runs of 256 new tokens after a warm-up), and the compile seconds. Run from the
repository's root:

  python docs/results/gpu/gpu_step_flags.py OUT.json          # SMALL=1: 2 layers (a CPU)
"""
import json, os, statistics, subprocess, sys, time

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {   # name: (XLA_FLAGS, [(dtype, batch), ...])
    "defaults": ("", [("float32", 1), ("float32", 16), ("bfloat16", 1)]),
    "command buffers + while + conditional": (
        COMMAND_BUFFERS + ",WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1",
        [("float32", 1), ("float32", 16), ("bfloat16", 1)]),
    "command buffers, any size": (COMMAND_BUFFERS + " --xla_gpu_graph_min_graph_size=1", [("float32", 1)]),
    "command buffers off": ("--xla_gpu_enable_command_buffer=", [("float32", 1)]),
    "autotuning off": ("--xla_gpu_autotune_level=0", [("float32", 1)]),
}
NEW_TOKENS, PROMPT_TOKENS, REPEATS = 256, 128, 3


def child(dtype: str, batch: int) -> dict:
  """One setting's timings, in this process (its XLA_FLAGS already set)."""
  sys.path.insert(0, os.getcwd())
  import jax
  import numpy as np
  from hitree_jax.decode import engine
  from hitree_jax.decode.programs import Programs
  from hitree_jax.model.config import ModelConfig
  from hitree_jax.model.llama import init_params
  layers = 2 if os.environ.get("SMALL") == "1" else 30
  config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=layers,
                       num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True, dtype=dtype, eos_token_id=None)
  params = init_params(config, jax.random.key(0))
  prompts = np.random.default_rng(0).integers(3, config.vocab_size, (batch, PROMPT_TOKENS)).tolist()
  programs = Programs()
  run = lambda: engine.generate(params, config, prompts, max_new_tokens=NEW_TOKENS, programs=programs)
  start = time.perf_counter()
  warm = run()
  first_s = time.perf_counter() - start
  steps = [run().decode_s / (NEW_TOKENS - 1) for _ in range(REPEATS)]
  return {"dtype": dtype, "batch": batch, "ms_per_step": 1e3 * statistics.median(steps),
          "ms_per_step_runs": [1e3 * s for s in steps], "first_call_s": first_s,
          "compile_s": warm.compile_s, "compiles": warm.compiles, "device": str(jax.devices()[0]),
          "jax": jax.__version__}


def main(out: str) -> None:
  sys.path.insert(0, os.getcwd())
  from hitree_jax import provenance
  record = {**provenance.stamp(), "new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS, "repeats": REPEATS,
            "runs": []}
  for name, (xla_flags, runs) in VARIANTS.items():
    for dtype, batch in runs:
      env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip())
      proc = subprocess.run([sys.executable, __file__, "--child", dtype, str(batch)], env=env,
                            capture_output=True, text=True)
      if proc.returncode:
        run = {"variant": name, "dtype": dtype, "batch": batch, "error": proc.stderr[-1500:]}
      else:
        run = {"variant": name, "xla_flags": xla_flags, **json.loads(proc.stdout.strip().splitlines()[-1])}
      record["runs"].append(run)
      print(json.dumps(run), flush=True)
      with open(out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
  if sys.argv[1] == "--child":
    print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
  else:
    main(sys.argv[1])
