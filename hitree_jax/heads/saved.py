"""A trained draft on the target's features, on disk: an orbax checkpoint of its own parameters
and `heads.json` (its kind, the target's shape it was trained for, its vocabulary and how it was
made). Writing one is training's last step (train/heads.py, launch.distill); reading one is all
inference needs, so it lives here, beside the drafters.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hitree_jax import shipped
from hitree_jax.errors import NotFound, UsageError
from hitree_jax.heads import dflash_format, eagle, eagle3, medusa, medusa_format
from hitree_jax.heads.drafter import DFlashDrafter, EagleDrafter, MedusaDrafter
from hitree_jax.loading.checkpoint import restore
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.vocab import ReducedVocab

META = shipped.HEADS_META
KINDS = {"eagle": eagle.TRAINED, "medusa": medusa.OWN}  # each kind's trained parameters


def frozen_arrays(target_params, vocab: ReducedVocab | None) -> dict:
  """What the draft reads from its target: the embedding [V, E] and the head on its ids [E, V']."""
  return {"embedding": target_params["embed_tokens"]["embedding"],
          "head": eagle.head_from_target(target_params, None if vocab is None else vocab.target_ids)}


def save(path: pathlib.Path, kind: str, params, target_config: ModelConfig, vocab: ReducedVocab | None,
         meta: dict) -> None:
  """Writes the trained parameters and the vocabulary with orbax, and heads.json."""
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  own = {name: jax.tree.map(np.asarray, params[name]) for name in KINDS[kind] if name in params}
  tree = {"params": own, "target_ids": np.asarray(vocab.target_ids if vocab else [-1], np.int32)}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path / "checkpoint", tree, force=True)
  shape = dict(hidden_size=target_config.hidden_size, num_heads=target_config.num_heads,
               num_kv_heads=target_config.num_kv_heads, head_dim=target_config.head_dim,
               intermediate_size=target_config.intermediate_size,
               target_vocab_size=target_config.vocab_size, vocab_size=vocab.size if vocab else None,
               qkv_bias=target_config.qkv_bias, o_bias=target_config.o_bias)
  if kind == "medusa":
    shape["medusa_heads"] = int(params["blocks"].shape[0])
  (path / META).write_text(json.dumps({"kind": kind, **shape, **meta}, indent=1))


PUBLISHED = {"medusa": medusa_format, "dflash": dflash_format, "eagle3": eagle3}   # each format's reader


def _published(folder: pathlib.Path, kind: str | None):
  """The module that reads `folder` when it holds a published draft (shipped.published_kind) of
  `kind` (any: None); else None."""
  found = shipped.published_kind(folder)
  return PUBLISHED[found] if found is not None and kind in (None, found) else None


def _folder(path, kind: str | None) -> pathlib.Path:
  """The folder of a saved draft, as given or a shipped one (drafts/NAME): NotFound naming the
  path when it holds no heads.json nor a published draft (PUBLISHED)."""
  folder = shipped.find(path)
  if not (folder / META).is_file() and _published(folder, kind) is None:
    raise NotFound(f"{kind or 'feature'} draft {str(path)!r} not found: expected a folder "
                   f"with {META} (written by `python -m launch.distill --kind={kind or 'eagle'}`)")
  return folder


def read_meta(path, kind: str | None = None) -> dict:
  """heads.json of a saved draft (no weights read): NotFound naming the path, or UsageError when
  it is not of `kind`."""
  return _meta_in(_folder(path, kind), path, kind)


def _meta_in(folder: pathlib.Path, path, kind: str | None) -> dict:
  if (folder / META).is_file():
    try:
      meta = json.loads((folder / META).read_text())
      meta["kind"]
    except (ValueError, KeyError, TypeError) as e:
      raise UsageError(f"{folder / META}: not a whole heads.json ({type(e).__name__}: {e})") from None
  else:
    meta = _published(folder, kind).read_meta(folder)
  if kind is not None and meta["kind"] != kind:
    raise UsageError(f"{str(path)!r} holds {meta['kind']} heads, not {kind}: use {meta['kind']}:{path}")
  return meta


def drafter(meta: dict, target_config: ModelConfig, mode: str = "deterministic"):
  """The EagleDrafter or MedusaDrafter a saved draft (its heads.json) describes."""
  size = meta.get("vocab_size")
  reduced = target_config.vocab_size if size else None
  size = size or target_config.vocab_size
  if meta["kind"] == "eagle3":
    size = meta["draft_vocab_size"] + 1 if meta["reduced"] else target_config.vocab_size   # + OTHER
    config = ModelConfig.from_dict(meta["draft_config"]).replace(vocab_size=size, dtype=target_config.dtype)
    return EagleDrafter(config, mode, target_config.vocab_size if meta["reduced"] else None,
                        taps=eagle3.taps(meta, target_config), net=eagle3.net(meta))
  if meta["kind"] == "dflash":
    config = ModelConfig.from_dict(meta["draft_config"]).replace(dtype=target_config.dtype)
    return DFlashDrafter(config, dflash_format.spec(meta), mode)
  if meta["kind"] == "medusa":
    published = meta.get("format") == "medusa"
    return MedusaDrafter(meta["medusa_heads"], size, mode, reduced,
                         layers=meta.get("medusa_layers", 1), published=published)
  return EagleDrafter(eagle.layer_config(target_config, size), mode, reduced,
                      taps=tuple(meta.get("taps", ())))


def check_target(meta: dict, target_config: ModelConfig, path) -> None:
  """Refuses a draft trained for a target of another shape (from heads.json alone)."""
  want = dict(hidden_size=target_config.hidden_size, num_heads=target_config.num_heads,
              num_kv_heads=target_config.num_kv_heads, target_vocab_size=target_config.vocab_size,
              qkv_bias=target_config.qkv_bias, o_bias=target_config.o_bias,
              num_layers=target_config.num_layers)
  # An EAGLE layer has its target's attention biases; a file from before they were recorded
  # was trained for a target without any. Published drafts say only what they know of it.
  checked = meta.get("checked", ("hidden_size", "num_heads", "num_kv_heads", "target_vocab_size",
                                 "qkv_bias", "o_bias"))
  want = {k: v for k, v in want.items() if k in checked}
  got = {k: meta.get(k, False if k.endswith("_bias") else None) for k in want}
  wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
  if wrong:
    raise UsageError(f"{meta['kind']} draft {str(path)!r} was trained for another target: " + ", ".join(
        f"{k} {got} (this target: {need})" for k, (got, need) in wrong.items()))


def load(path, target_params, target_config: ModelConfig, kind: str | None = None):
  """(heads.json, its params with the target's head on its ids, ReducedVocab or None)."""
  folder = _folder(path, kind)
  meta = _meta_in(folder, path, kind)
  check_target(meta, target_config, path)
  as_target = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(target_config.dtype)), tree)
  if meta.get("format") == "medusa":   # published heads: their own output matrices, no vocab
    return meta, as_target(medusa_format.load_params(folder, meta)), None
  if meta["kind"] == "eagle3":          # its own lm_head over its vocabulary (d2t)
    params, vocab = eagle3.load(folder, meta, target_config)
    return meta, as_target(params), vocab
  if meta["kind"] == "dflash":   # published (z-lab's or speculators'): the target's embedding and head
    params = as_target(dflash_format.load_params(folder, meta))
    return meta, dict(params, head=frozen_arrays(target_params, None)["head"]), None
  tree = restore(folder / "checkpoint")
  ids = np.asarray(tree["target_ids"])
  vocab = ReducedVocab(ids, target_config.vocab_size) if ids.size > 1 else None
  params = as_target(tree["params"])
  params["head"] = frozen_arrays(target_params, vocab)["head"]
  return meta, params, vocab
