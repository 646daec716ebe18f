"""Flags and helpers shared by the launchers."""

from __future__ import annotations

import dataclasses

from absl import flags

METHODS = ("ar", "sd", "tree")


def define_model_flags():
  flags.DEFINE_string("model", "smollm2", "smollm2, a .gguf file, an HF folder or a launch.convert checkpoint.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype (float32 on CPU).")


def define_sampling_flags():
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1 = off.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
  flags.DEFINE_integer("seed", 0, "PRNG seed: a run is reproducible from it.")


def define_speculation_flags():
  flags.DEFINE_string("draft", "self:8", "Drafter: self:K[,iid|without_replacement|deterministic] "
                      "(the target's first K layers) or ngram[:N] (prompt lookup).")
  flags.DEFINE_integer("gamma", 4, "Draft tokens per round for --method=sd.")
  flags.DEFINE_string("tree", "kary:2x2", "Tree for --method=tree: chain:N or kary:KxD.")


def sampling_from_flags(FLAGS):
  from hitree_jax.sampling import SamplingParams
  return SamplingParams.create(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k)


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding configuration: `ar`, or `sd` / `tree` with a drafter and a tree."""
  name: str
  drafter: object = None
  tree: object = None
  label: str = "ar"

  def generate(self, params, config, prompts, **kwargs):
    from hitree_jax import decoding, engine
    if self.name == "ar":
      return decoding.generate(params, config, prompts, **kwargs)
    return engine.generate(params, config, prompts, tree=self.tree, drafter=self.drafter, **kwargs)


def parse_method(spec: str, draft: str, gamma: int, tree: str) -> Method:
  """`ar`, `sd[/DRAFT[/GAMMA]]` or `tree[/DRAFT[/TREE]]`; missing parts come from the flags.

  e.g. sd/ngram/4, tree/self:8/kary:2x2, tree/self:4,without_replacement/chain:6
  """
  from hitree_jax import tree as tree_lib
  from hitree_jax.drafters import parse_draft_spec
  name, *parts = spec.split("/")
  if name not in METHODS or (name == "ar" and parts) or len(parts) > 2:
    raise ValueError(f"method {spec!r} is not available; use ar, sd[/DRAFT[/GAMMA]] or "
                     f"tree[/DRAFT[/TREE]] with methods {METHODS}")
  if name == "ar":
    return Method("ar")
  draft = parts[0] if parts else draft
  if draft.startswith(("/", ".")) or draft.endswith(".gguf"):
    raise ValueError(f"--draft={draft}: a separate draft model is not supported yet; "
                     "use self:K or ngram[:N]")
  drafter = parse_draft_spec(draft)
  shape = parts[1] if len(parts) > 1 else None
  if name == "sd":
    n = int(shape) if shape else gamma
    if n < 1:
      raise ValueError(f"gamma={n} must be >= 1")
    token_tree, shape = tree_lib.chain(n), str(n)
  else:
    shape = shape or tree
    token_tree = tree_lib.parse_tree_spec(shape)
    if not isinstance(token_tree, tree_lib.TokenTree):
      raise ValueError(f"--tree={shape}: {token_tree[0]} trees are not supported yet; "
                       "use chain:N or kary:KxD")
  return Method(name, drafter, token_tree, f"{name}/{draft}/{shape}")
