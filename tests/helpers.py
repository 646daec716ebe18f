"""Helpers that several test modules share (imported from here, never from another test file)."""

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.model.config import ModelConfig
from hitree_jax.model.vocab import ReducedVocab

REPO = pathlib.Path(__file__).resolve().parent.parent


def launch(module, *args, timeout=600, env=None):
  """`python -m launch.MODULE ARGS` from the repository's root: the finished process."""
  return subprocess.run([sys.executable, "-m", f"launch.{module}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, env=env)


def real_model_environ(environ=None) -> dict:
  """The environment for a launcher that compiles the real SmolLM2: conftest's XLA flags without
  its older fusion emitters, which compile the suite's tiny models faster but SmolLM2's stacks
  slower (an `sd` stack at 500 prompt tokens: 15.5 s of compiling, 12.8 s without them; TriForce
  at 2K tokens: 48 s, 39 s)."""
  environ = dict(os.environ if environ is None else environ)
  flags = environ.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false", "")
  environ["XLA_FLAGS"] = " ".join(flags.split())
  return environ


def tiny_target():
  """A 3-layer random-weights target of 53 tokens (with peaked(TINY, seed)): what the engine's
  and the drafters' exactness tests decode."""
  from hitree_jax.model.config import ModelConfig
  return ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None)


def peaked(config, seed: int) -> dict:
  """Random weights, the matrices scaled 4x so that greedy decoding meets no near-ties (the two
  best logits far apart), so a speculative method's tokens equal ar's on every machine."""
  from hitree_jax.model.llama import init_params
  params = init_params(config, jax.random.key(seed))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)


def tiny_model_gguf(path: pathlib.Path, max_positions: int = 1024, num_layers: int = 1,
                    width: int = 32, heads: tuple[int, int] = (2, 1)) -> pathlib.Path:
  """A random model of `num_layers` layers with SmolLM2's tokenizer and chat template, written to
  `path`: for launcher tests of what does not depend on the model's size (it compiles in seconds,
  SmolLM2's 30 layers in a minute). width: its hidden size (MLP twice that); heads: its query and
  KV heads, each width / query heads wide."""
  from hitree_jax.loading import resolve
  from hitree_jax.loading.gguf import save_gguf
  from hitree_jax.model.config import ModelConfig
  config = ModelConfig(vocab_size=49152, hidden_size=width, intermediate_size=2 * width, num_layers=num_layers,
                       num_heads=heads[0], num_kv_heads=heads[1], head_dim=width // heads[0],
                       max_position_embeddings=max_positions)
  return save_gguf(path, config, peaked(config, 0), quantize=False, tokenizer_from=resolve("smollm2"))


def hf_llama(folder: pathlib.Path, num_layers: int, **shape):
  """Our load of transformers' random Llama of `shape` (seed 0, initializer_range 0.1), saved as an
  HF folder: a target whose folder a published draft's config can name as its verifier."""
  import torch
  import transformers
  from hitree_jax.loading import load_model
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=num_layers,
                                                                  initializer_range=0.1, **shape)).eval()
  model.save_pretrained(folder)
  return load_model(str(folder))


def our_logits(model, tokens):
  """Logits [T, V] of one cache-free causal forward of a loaded model over `tokens`."""
  from hitree_jax.cache.full import KVCache, causal_attend
  from hitree_jax.model.llama import forward
  n = len(tokens)
  cache = KVCache.init(model.config, 1, n)
  logits, _, _ = forward(model.params, model.config, jnp.asarray([tokens]), jnp.arange(n)[None],
                         cache, causal_attend(cache.lengths, n, n))
  return np.asarray(logits[0])


def with_random_biases(params, seed=2):
  """init_params' biases are zeros, where a dropped or unpermuted one would not show."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: rng.standard_normal(x.shape).astype(np.float32)
      if jax.tree_util.keystr(path).endswith("['bias']") else x, params)


def synthetic_profile(context=512, space=None):
  """A profile as auto.measure stores it (JSON: string widths), with made-up but plausible
  numbers: costs grow with width, acceptance falls with the gap between two levels."""
  from hitree_jax.planner import auto
  space = (space or auto.Space()).for_context(context)
  base = {"target": 0.020, "retrieval:256": 0.013, "retrieval:512": 0.015, "retrieval:1024": 0.017,
          "self:8": 0.007, "draft": 0.0024, "draft@streaming:16x234": 0.0018, "eagle": 0.0012}
  quality = {"target": 1.0, "retrieval:256": 0.9, "retrieval:512": 0.93, "retrieval:1024": 0.95,
             "self:8": 0.1, "draft": 0.45, "draft@streaming:16x234": 0.4, "ngram:3": 0.3, "eagle": 0.7}
  costs = {name: {str(w): base[name] * (1 + 0.08 * (w - 1)) for w in space.widths}
           for name in map(str, space.levels()) if name in base}
  acceptance = {}
  for verifier, proposer in space.pairs():
    quality_of = lambda level: quality[str(level)]
    a = quality_of(proposer) / quality_of(verifier) if quality_of(proposer) < quality_of(verifier) else 0.95
    ranks = [a] + [(1 - a) * 0.5 ** r for r in range(1, 8)]   # p(x_r) of distinct tokens: sum <= 1
    acceptance[f"{verifier}<-{proposer}"] = {"alpha": a, "greedy": a, "profile": ranks, "greedy_profile": ranks}
  return {"context": context, "costs": costs, "acceptance": acceptance,
          "overheads": {"draft_forward": 0.0005, "verify": 0.002, "tree": 0.006}, "ar_seconds": 0.05}


def planned_label(choice, draft: str, eagle: str | None = None) -> str:
  """How a run labels the plan `choice` after its method's name: its levels, then the step aside at
  its break-even where it has one (a model drafter right under the target)."""
  from hitree_jax.decode.step_aside import StepAside
  aside = choice.flags(draft, eagle).get("step_aside")
  return str(choice.levels).split('/', 1)[1] + (f"/aside:{StepAside.parse(aside)}" if aside else "")


# A tiny target and draft, as a shapes config (launch.level_cost, launch.plan_memory --shapes).
TINY_SHAPES = """
from ml_collections import config_dict
def get_config():
  shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4,
               head_dim=8, max_position_embeddings=4096, dtype="bfloat16")
  return config_dict.ConfigDict(dict(
      target=dict(shape, num_layers=2), draft=dict(shape, num_layers=1), prompt_tokens=1500,
      max_new_tokens=32, batch=1, budget=256, sinks=4, window=60, gamma1=1, gamma2=4))
"""


# --- The KV-cache tests' tiny model (tests/test_kv_cache.py, tests/test_cache_family.py) ---

CACHE_CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)


@functools.lru_cache(maxsize=None)
def tiny_params(seed=0):
  """Random params of CACHE_CONFIG in `init_params`' tree (built in numpy: eager Flax init costs
  seconds).

  Scaled so attention is sharp and logits depend visibly on context; norm weights are
  perturbed away from 1.
  """
  from hitree_jax.model.llama import init_params
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(functools.partial(init_params, CACHE_CONFIG), jax.random.key(seed))

  def fill(path, leaf):
    name = jax.tree_util.keystr(path)
    x = rng.standard_normal(leaf.shape)
    if "norm" in name:
      x = 1.0 + 0.1 * x
    elif "kernel" in name:
      x = x / np.sqrt(leaf.shape[0]) * (2.0 if ("q_proj" in name or "k_proj" in name) else 1.0)
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


# --- The distillation tests' tiny teacher (tests/test_distill.py, tests/test_heads_training.py;
# its params and labelled data are conftest's teacher_params and distill_data fixtures) ---

TEACHER = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


# --- The EAGLE tests' tiny target and drafts (tests/test_heads.py, tests/test_planner.py) ---

# One layer: an EAGLE layer that copies it reproduces the target exactly.
HEADS_CONFIG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None)
# EAGLE-3: a 3-layer target whose first two layers an EAGLE-3 draft taps, beside its final states.
TAPPED = HEADS_CONFIG.replace(num_layers=3)
TAPS = (0, 1)


def target_params(config, seed=0):
  from hitree_jax.model.llama import init_params, with_decode_head
  p = init_params(config, jax.random.key(seed))
  p = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, p)  # peaked: no greedy near-ties
  return with_decode_head(p, config)


def eagle_draft(target, config, feature_weight: float, vocab: ReducedVocab | None = None, mode="deterministic"):
  """(drafter, weights): an EAGLE layer that is the 1-layer target's own layer, reading the
  token's embedding plus feature_weight x a random map of the previous feature: with 0 it is
  the target itself; otherwise it depends on the features it is handed."""
  from hitree_jax.decode.drafters import DraftWeights
  from hitree_jax.heads import eagle
  from hitree_jax.heads.drafter import EagleDrafter
  e = config.hidden_size
  mix = feature_weight * jax.random.normal(jax.random.key(5), (e, e)) / np.sqrt(e)
  params = {"fc": {"kernel": jnp.concatenate([jnp.eye(e), mix], axis=0)},
            "layer": target["layers_0"], "norm": target["norm"],
            "head": eagle.head_from_target(target, None if vocab is None else vocab.target_ids)}
  size = config.vocab_size if vocab is None else vocab.size
  drafter = EagleDrafter(eagle.layer_config(config, size), mode,
                         None if vocab is None else vocab.target_vocab_size)
  return drafter, DraftWeights.create(params, vocab)


def eagle3_draft(target, config, taps, mode="deterministic"):
  """(drafter, weights): eagle_draft's layer, reading the fusion of the target's taps and final
  states through a random map, so that what it drafts depends on every tapped layer."""
  import dataclasses
  from hitree_jax.decode.drafters import DraftWeights
  drafter, weights = eagle_draft(target, config, 1.0, mode=mode)
  e, k = config.hidden_size, len(taps)
  kernel = jax.random.normal(jax.random.key(7), ((k + 1) * e, e)) / np.sqrt(e)
  params = dict(weights.params, fuse={"scale": jnp.ones((k, e)), "kernel": kernel})
  return dataclasses.replace(drafter, taps=taps), DraftWeights.create(params)


# --- The TPU compile tests' long-context model (tests/test_tpu_compile.py, tests/test_roofline.py) ---

# Tiny, but its full cache is long (120,000 prompt tokens, 4 layers of 16 KV heads of 64: 2 GB).
TARGET = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=16,
                     num_kv_heads=16, head_dim=64, max_position_embeddings=131072, dtype="bfloat16")
DRAFT = TARGET.replace(num_layers=1, num_heads=2, num_kv_heads=1)


def kv_bytes(config: ModelConfig, slots: int, heads_split: int = 1, slots_split: int = 1) -> int:
  """Keys and values of a cache, by hand: layers x 2 x KV heads x head_dim x slots x bytes."""
  return (config.num_layers * 2 * (config.num_kv_heads // heads_split) * config.head_dim
          * (slots // slots_split) * 2)
