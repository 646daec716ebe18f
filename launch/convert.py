"""Convert weights (GGUF or HF safetensors) to an orbax checkpoint, or to a GGUF for llama.cpp.

  python -m launch.convert --model=smollm2 --out=checkpoints/smollm2
  python -m launch.generate --model=checkpoints/smollm2 --prompt="..."
  python -m launch.convert --model=smollm2 --out=smollm2_f32.gguf   # llama.cpp at F32

An --out ending in .gguf writes a llama.cpp GGUF: float32 matrices by default
(--gguf_type=q8_0 for llama.cpp's 8-bit blocks), with the source's tokenizer (a
GGUF's, or a Hugging Face folder's or checkpoint's byte-level BPE tokenizer.json).
The shipped SmolLM2 file is Q4_1: its F32 copy holds exactly the weights our
float32 model decodes with, which is what comparing decode speed with llama.cpp
"at the same precision" means (launch.benchmark --peers).
"""

from __future__ import annotations

import time

from absl import flags, logging

from . import common

common.define_model_flags(key_dtype=False)
flags.DEFINE_string("out", None, "Folder to write the checkpoint to, or a .gguf file.", required=True)
flags.DEFINE_enum("gguf_type", "f32", ["f32", "q8_0"], "Matrix type of a .gguf --out.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from hitree_jax.loading import load_model
  from hitree_jax.model.llama import without_decode_head

  start = time.perf_counter()
  model = load_model(FLAGS.model, "float32")
  if FLAGS.out.endswith(".gguf"):
    from hitree_jax.loading.gguf import save_gguf
    from hitree_jax.tokenizer import gguf_tokenizer_source
    source = gguf_tokenizer_source(model.path)
    if source is None:
      logging.warning("%s has no tokenizer.json: %s is written without a tokenizer", model.path, FLAGS.out)
    save_gguf(FLAGS.out, model.config, without_decode_head(model.params, model.config), vocab=model.vocab,
              tokenizer_from=source, quantize=FLAGS.gguf_type == "q8_0")
  else:
    from hitree_jax.loading.checkpoint import save_checkpoint
    from hitree_jax.tokenizer import load_tokenizer
    save_checkpoint(FLAGS.out, model.config, model.params, load_tokenizer(model.path))
  logging.info("wrote %s in %.1f s", FLAGS.out, time.perf_counter() - start)


def run():
  common.run(main)


if __name__ == "__main__":
  run()
