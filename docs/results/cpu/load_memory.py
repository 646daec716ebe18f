"""Host memory to load a 1B-shape GGUF (not part of the library): Llama-3.2-1B's shapes (128,256
tokens, 2,048 wide, 16 layers, tied embeddings) with random weights, written as Q8_0, then
loaded by `load_model` in float32 and in bfloat16, each in a fresh process: the peak of its
anonymous memory above its start (hitree_jax/loading/memory.py) against the bytes of the
weights it ends with (the decode head, a tied model's transposed embedding, included). Run
from the repository's root (any checkout: the child imports the hitree_jax it runs in):

  python docs/results/cpu/load_memory.py OUT.json [FOLDER]   # FOLDER keeps the 1.3 GB file between runs
"""
import json, os, subprocess, sys, tempfile

CHILD = """
import json, sys
from hitree_jax.loading import load_model
from hitree_jax.loading.memory import peak_while, tree_bytes
model, peak, before = peak_while(lambda: load_model(sys.argv[1], sys.argv[2]))
print(json.dumps({"dtype": sys.argv[2], "peak_above_start": peak - before, "weights": tree_bytes(model.params)}))
"""


def write_model(path: str) -> None:
  """Random weights of Llama-3.2-1B's shapes, Q8_0 (about 1.3 GB)."""
  import jax
  import numpy as np
  from hitree_jax.loading.gguf import save_gguf
  from hitree_jax.model.config import ModelConfig
  from hitree_jax.model.llama import init_params
  config = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                       num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=True)
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)).astype(np.float32), shapes)
  save_gguf(path, config, params, quantize=True)


def stamp() -> dict:
  """The checkout's provenance.stamp() (CPU, jax, commit), asked in a child as the loads are."""
  code = "import json; from hitree_jax import provenance; print(json.dumps(provenance.stamp()))"
  record = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
  return {**record, "command": " ".join(["python", *sys.argv])}


def main(out: str, folder: str | None = None) -> None:
  folder = folder or tempfile.mkdtemp()
  path = os.path.join(folder, "llama_1b_shape_q8_0.gguf")
  if not os.path.exists(path):
    write_model(path)
  runs = []
  for dtype in ("float32", "bfloat16"):
    proc = subprocess.run([sys.executable, "-c", CHILD, path, dtype], capture_output=True, text=True, check=True)
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    run["ratio"] = run["peak_above_start"] / run["weights"]
    runs.append(run)
    print(json.dumps(run), flush=True)
  with open(out, "w") as f:
    json.dump({**stamp(), "file": os.path.basename(path), "file_bytes": os.path.getsize(path), "runs": runs}, f,
              indent=2)


if __name__ == "__main__":
  main(*sys.argv[1:])
