"""Flags and helpers shared by the launchers."""

from __future__ import annotations

from absl import flags

METHODS = ("ar",)


def define_model_flags():
  flags.DEFINE_string("model", "smollm2", "smollm2, a .gguf file, an HF folder or a launch.convert checkpoint.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype (float32 on CPU).")


def define_sampling_flags():
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1 = off.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
  flags.DEFINE_integer("seed", 0, "PRNG seed: a run is reproducible from it.")


def sampling_from_flags(FLAGS):
  from hitree_jax.sampling import SamplingParams
  return SamplingParams.create(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k)


def check_method(method: str) -> None:
  if method not in METHODS:
    raise ValueError(f"method {method!r} is not available; available: {METHODS}")
