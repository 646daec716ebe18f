"""Measured cost curves of the planner's candidate levels (acceptance profiles are to come).

A level's cost at context length c and width w is the median time of one
forward of w tokens through its model, over its long cache of a c-token book
prompt (read-only context, as in decoding) and a recent cache: exactly the
forward a level runs in a round (logits included). Levels are named as in
the --levels grammar:

  target                    the target over its full cache
  retrieval:B               the target over a B-slot retrieval cache (TriForce's)
  self:K                    the target's first K layers over their full cache
  draft                     a draft model over its full cache
  draft@streaming:SxW       a draft model over a StreamingLLM cache of S sinks and W recent tokens

Profiles are JSON, reused while the key (model, draft, machine, jax version)
is the same (`cached`).
"""

from __future__ import annotations

import json
import pathlib
import platform
import re
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from hitree_jax.cache.full import KVCache
from hitree_jax.decode import engine
from hitree_jax.decode import prefill as prefill_lib
from hitree_jax.decode.drafters import round_attend
from hitree_jax.decode.programs import Programs
from hitree_jax.model.llama import forward

RECENT_SLOTS = 32   # a level's recent cache in decoding (engine.MIN_RECENT_SLOTS)
CHUNK = 8           # retrieval chunk (the launchers')


def median_seconds(fn: Callable, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compiles and warms up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _timed_forward(config):
  @jax.jit
  def run(params, tokens, long):
    w = tokens.shape[1]
    recent = KVCache.init(config, tokens.shape[0], RECENT_SLOTS, long.keys[0].dtype)
    positions = long.next_positions[:, None] + jnp.arange(w)[None, :]
    attend = round_attend(recent.lengths, RECENT_SLOTS, jnp.tril(jnp.ones((w, w), bool)))
    logits, _, _ = forward(params, config, tokens, positions, recent, attend, context=(long,))
    return logits
  return run


def _first_layers(params, cache: KVCache, k: int):
  kept = {name: value for name, value in params.items()
          if not name.startswith("layers_") or int(name.split("_")[1]) < k}
  return kept, cache.replace(keys=cache.keys[:k], values=cache.values[:k])


def level_costs(target, draft, names: Sequence[str], prompt: Sequence[int], widths: Sequence[int],
                repeats: int = 10) -> dict:
  """{level name: {width: seconds}} at the context of `prompt` (token ids of the target).
  target, draft: loading.LoadedModel (draft may be None when no name needs one)."""
  config, params = target.config, target.params
  slots = prefill_lib.cache_slots(len(prompt), 0, extra=RECENT_SLOTS)
  batch = prefill_lib.make_batch([list(prompt)], config, 1)
  programs = Programs()
  _, full = prefill_lib.prefill(params, config, KVCache.init(config, 1, slots), batch, programs)
  draft_full = None
  out = {}
  for name in names:
    level_config, level_params = config, params
    if name == "target":
      long = full
    elif m := re.fullmatch(r"retrieval:(\d+)", name):
      last = jnp.asarray([prompt[-1]], jnp.int32)
      long = engine._retrieval(params, config, full, last, int(m.group(1)), CHUNK, RECENT_SLOTS, 1)
    elif m := re.fullmatch(r"self:(\d+)", name):
      k = int(m.group(1))
      level_config = config.replace(num_layers=k)
      level_params, long = _first_layers(params, full, k)
    elif m := re.fullmatch(r"draft(?:@streaming:(\d+)x(\d+))?", name):
      if draft is None:
        raise ValueError(f"level {name!r} needs a draft model")
      level_config, level_params = draft.config, draft.params
      if draft_full is None:
        ids = list(prompt) if draft.vocab is None else draft.vocab.to_draft(prompt).tolist()
        draft_batch = prefill_lib.make_batch([ids], draft.config, 1)
        _, draft_full = prefill_lib.prefill(draft.params, draft.config, KVCache.init(draft.config, 1, slots),
                                            draft_batch, programs)
      long = draft_full if m.group(1) is None else engine._streaming(draft_full, int(m.group(1)),
                                                                     int(m.group(2)), None)
    else:
      raise ValueError(f"unknown level {name!r}: expected target, retrieval:B, self:K, draft or "
                       "draft@streaming:SxW")
    run = _timed_forward(level_config)
    out[name] = {w: median_seconds(run, level_params, jnp.zeros((1, w), jnp.int32), long, repeats=repeats)
                 for w in widths}
  return out


def profile_key(model: str, draft: str | None) -> dict:
  """What a profile is valid for: the models, the machine and the jax that measured it."""
  return {"model": model, "draft": draft, "machine": platform.machine(), "processor": platform.processor(),
          "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()[:1]],
          "jax": jax.__version__}


def cached(path: str | pathlib.Path, key: dict, measure: Callable[[], dict]) -> dict:
  """The profile stored at `path` if it was measured for `key`, else measure() stored there."""
  path = pathlib.Path(path)
  if path.exists():
    stored = json.loads(path.read_text())
    if stored.get("key") == key:
      return stored["profile"]
  profile = measure()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"key": key, "profile": profile}, indent=1))
  return json.loads(path.read_text())["profile"]   # as a reader sees it (JSON keys are strings)
