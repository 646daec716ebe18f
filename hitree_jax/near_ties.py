"""Whether a greedy run that parted from `ar` parted at a near-tie of the target.

Greedy speculative decoding commits the target's argmax at every position, as `ar` does, but
reads it from forwards of other widths (a round verifies several tokens at once). Their products
round differently: on a GPU float32 products use TF32 by JAX's default, and in bfloat16 any
accelerator rounds coarsely. Where the target's two best logits are within that rounding of each
other, the two runs can pick different tokens and go on differently from there. The margin
between the target's two best logits where the runs part tells a near-tie (a margin far below
the answer's typical one) from a fault (a wide margin overruled).

Where that line falls (TIE_MARGINS) is measured, not derived: on an H100 the five Spec-Bench
turns that parted from `ar` in float32 (TF32 products) did so at margins of at most 0.026, on
answers whose median margin was 2.95; 0.05 leaves twice that. bfloat16 keeps 8 significant bits
to TF32's 11, so its roundings are up to 8x wider: 0.5 (0.4 rounded up). The launchers exit
non-zero on a parting wider than its precision's line (launch.benchmark, book passages and
Spec-Bench alike).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.decode.prefill import round_up
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import forward


TIE_MARGINS = {"float32": 0.05, "bfloat16": 0.5}
MARGIN_BUCKET = 256   # answers are padded to this: one program per bucket, not one per length


def tie_margin(config: ModelConfig) -> float:
  """The widest top-2 logit margin that rounding alone may overturn for this target: bfloat16's
  line where its weights or its cached keys are bfloat16, float32's otherwise."""
  coarse = "bfloat16" in (config.dtype, config.key_dtype)
  return TIE_MARGINS["bfloat16" if coarse else "float32"]


def top2_margins(params, config: ModelConfig, prompt: list[int], answer: list[int]) -> np.ndarray:
  """[len(answer) + 1] float32: the target's top-1 minus top-2 logit at each answer position and
  at the one after it, from one causal forward over prompt + answer (each row predicts the next
  token)."""
  tokens = list(prompt) + list(answer)
  n = len(tokens)
  if not prompt or n > config.max_position_embeddings:
    raise ValueError(f"top2_margins: {len(prompt)} prompt + {len(answer)} answer tokens do not fit "
                     f"1..{config.max_position_embeddings} positions")
  padded = np.zeros((1, min(round_up(n, MARGIN_BUCKET), config.max_position_embeddings)), np.int32)
  padded[0, :n] = tokens   # the padding comes after: a causal forward's rows up to n never see it
  return np.asarray(_margins(params, config, jnp.asarray(padded)))[len(prompt) - 1:n]


@functools.partial(jax.jit, static_argnums=(1,))
def _margins(params, config: ModelConfig, tokens):
  """[P] float32: top-1 minus top-2 logit at each row of one causal forward over tokens [1, P]."""
  width = tokens.shape[1]
  cache = KVCache.init(config, 1, width)
  logits, _, _ = forward(params, config, tokens, jnp.arange(width)[None], cache,
                         causal_attend(cache.lengths, width, width))
  best_two = jax.lax.top_k(logits[0].astype(jnp.float32), 2)[0]     # [P, 2], largest first
  return best_two[:, 0] - best_two[:, 1]


def parting(margins: np.ndarray, at: int, tie: float | None = None) -> dict:
  """What the margin where two runs part says, against the margins of the rest of the answer:
  {margin, smaller_in_answer (how many positions had a smaller one), median_margin}, and with
  `tie` (tie_margin) near_tie: whether rounding alone may explain it."""
  out = {"margin": float(margins[at]), "smaller_in_answer": int((margins < margins[at]).sum()),
         "median_margin": float(np.median(margins))}
  if tie is not None:
    out["near_tie"] = bool(out["margin"] <= tie)
  return out


def compare(prompt: list[int], tokens: list[int], ar_tokens: list[int], margins_of=None,
            tie: float | None = None) -> dict | None:
  """None where a greedy run's tokens equal `ar`'s; else {at: the first index that differs (a
  shorter answer differs where it ends)}, with margins_of(prompt, answer) (top2_margins over
  `ar`'s answer) also `parting`'s figures there."""
  if tokens == ar_tokens:
    return None
  at = next((i for i, (x, y) in enumerate(zip(tokens, ar_tokens)) if x != y), min(len(tokens), len(ar_tokens)))
  out = {"at": at}
  if margins_of is not None:
    out.update(parting(margins_of(prompt, ar_tokens), at, tie))
  return out


def faults(partings: list[dict]) -> list[dict]:
  """The partings that no near-tie explains (judged: near_tie is False)."""
  return [d for d in partings if d.get("near_tie") is False]


def describe(d: dict) -> str:
  """A parting (compare's dict) in words, after the run it names."""
  line = f"differs from ar at token {d['at']}"
  if "margin" in d:
    line += (f": the target's top-2 logit margin there is {d['margin']:.4f} (median over ar's "
             f"answer {d['median_margin']:.2f}; {d['smaller_in_answer']} positions had a smaller one)")
  if "near_tie" in d:
    line += ", a near-tie" if d["near_tie"] else ", wider than a near-tie: not rounding"
  return line


def fault_message(rows: list[dict], tie: float, where) -> str | None:
  """One line on the greedy runs that parted from `ar` wider than a near-tie (each row's
  differs_from_ar, judged against `tie`), the first named by where(parting); None if none."""
  bad = [(r["method"], d) for r in rows for d in faults(r.get("differs_from_ar", []))]
  if not bad:
    return None
  method, d = bad[0]
  return (f"{len(bad)} greedy runs parted from ar at a top-2 logit margin wider than a near-tie "
          f"({tie}); the first: {method}: {where(d)} {describe(d)}")
