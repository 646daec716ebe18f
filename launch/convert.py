"""Convert weights (GGUF or HF safetensors) to an orbax checkpoint that restores fast.

  python -m launch.convert --model=smollm2 --out=checkpoints/smollm2
  python -m launch.generate --model=checkpoints/smollm2 --prompt="..."
"""

from __future__ import annotations

import time

from absl import flags, logging

from launch import common

common.define_model_flags()
flags.DEFINE_string("out", None, "Folder to write the checkpoint to.", required=True)
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from hitree_jax.loading import load_model
  from hitree_jax.loading.checkpoint import save_checkpoint
  from hitree_jax.tokenizer import load_tokenizer

  start = time.perf_counter()
  model = load_model(FLAGS.model, "float32")
  save_checkpoint(FLAGS.out, model.config, model.params, load_tokenizer(model.path))
  logging.info("wrote %s in %.1f s", FLAGS.out, time.perf_counter() - start)


def run():
  common.run(main)


if __name__ == "__main__":
  run()
