"""Convert weights (GGUF or HF safetensors) to an orbax checkpoint, or to a GGUF for llama.cpp;
or a model, Medusa heads or an EAGLE-3 draft from a pickle to safetensors.

  python -m launch.convert --model=smollm2 --out=checkpoints/smollm2
  python -m launch.generate --model=checkpoints/smollm2 --prompt="..."
  python -m launch.convert --model=smollm2 --out=smollm2_f32.gguf   # llama.cpp at F32
  python -m launch.convert --medusa=medusa-vicuna-7b-v1.3           # writes medusa_lm_head.safetensors
  python -m launch.convert --eagle3=EAGLE3-LLaMA3.1-Instruct-8B        # writes model.safetensors
  python -m launch.convert --pickled=path/to/model                     # pytorch_model.bin -> model.safetensors

An --out ending in .gguf writes a llama.cpp GGUF: float32 matrices by default
(--gguf_type=q8_0 for llama.cpp's 8-bit blocks), with the source's tokenizer (a
GGUF's, or a Hugging Face folder's or checkpoint's byte-level BPE tokenizer.json).
The shipped SmolLM2 file is Q4_1: its F32 copy holds exactly the weights our
float32 model decodes with, which is what comparing decode speed with llama.cpp
"at the same precision" means (launch.benchmark --peers).
"""

from __future__ import annotations

import pathlib
import time

from absl import flags, logging

from hitree_jax.errors import UsageError

from . import common

common.define_model_flags(key_dtype=False)
flags.DEFINE_string("out", None, "Folder to write the checkpoint to, or a .gguf file; with "
                    "--medusa, a folder for the converted heads (default: beside the pickle).")
flags.DEFINE_enum("gguf_type", "f32", ["f32", "q8_0"], "Matrix type of a .gguf --out.")
flags.DEFINE_string("medusa", None, "A folder of FasterDecoding's Medusa heads whose weights are "
                    "the pickle medusa_lm_head.pt: write them as medusa_lm_head.safetensors, which "
                    "--draft=medusa:PATH reads (needs torch; the pickle is read with "
                    "weights_only=True, which runs none of its code).")
flags.DEFINE_string("eagle3", None, "A folder of an EAGLE-3 draft whose weights are the pickle "
                    "pytorch_model.bin: write them as model.safetensors, which --draft=eagle3:PATH "
                    "reads (as --medusa).")
flags.DEFINE_string("pickled", None, "An HF model folder whose weights are the pickle "
                    "pytorch_model.bin (or its shards): write them as model.safetensors, which "
                    "--model=PATH reads (as --medusa; --out: another folder, the others copied).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if FLAGS.pickled:
    from hitree_jax.loading.hf import rewrite_pickled
    logging.info("wrote %s", rewrite_pickled(FLAGS.pickled, FLAGS.out or FLAGS.pickled))
    return
  from hitree_jax.heads import eagle3, medusa_format
  for flag, format_module in (("medusa", medusa_format), ("eagle3", eagle3)):
    if getattr(FLAGS, flag):
      folder = pathlib.Path(getattr(FLAGS, flag))
      logging.info("wrote %s", format_module.rewrite_pickle(folder, pathlib.Path(FLAGS.out or folder)))
      return
  if not FLAGS.out:
    raise UsageError("--out is required: a folder for the checkpoint, or a .gguf file")
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
