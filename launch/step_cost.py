"""Where a decoded token's time goes: isolated timings of each part of a step, per context length.

  python -m launch.step_cost --prompt_tokens=512,2048,7680 --widths=1,2,4,5,8,16 \
      --temperature=0.6 --top_p=0.9 --out=step_cost.json

For each prompt length it builds the target's caches as `generate` does (a long
cache of the prompt, rounded up to the cache bucket, and a 32-slot recent
cache) and times, as separate programs, the median of --repeats runs:

  forward     w tokens through the model over both caches, logits included
                (w = 1 is an `ar` step's forward; w > 1 a verification's)
  layers      the same w tokens over the recent cache only: the weight matrices
                and the per-layer work, without the long context
  head        the output head (hidden -> logits) of w positions
  attention   forward - layers - head: reading the long cache
  sampling    logits of w positions -> the distribution sampled from, and a draw
  verify      exact verification of a (w-1)-token chain against those distributions

and `step`, one real `ar` decode step (decode time / tokens of a 128-token
generation), whose excess over forward + sampling is the loop's own cost
(bookkeeping, the recent cache's block appends). With --peers=llamacpp it also
times llama.cpp's forward of w tokens after the same prompt. With --xla_profile
it splits the forward again by XLA's profiler, op by op, into weights, head,
attention, other ops and XLA's runtime, with the rate the weights are read at
(launch/xla_profile.py). Writes OUT (JSON) and OUT.md.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import flags

from hitree_jax.errors import UsageError
from . import common, peers

common.define_config_flag()
common.define_model_flags()
common.define_sampling_flags()
flags.DEFINE_list("prompt_tokens", ["512", "2048", "7680"], "Context lengths (book prompts of this many tokens).")
flags.DEFINE_list("widths", ["1", "2", "4", "5", "8", "16"], "Tokens per forward.")
flags.DEFINE_integer("repeats", 20, "Timed runs of each part (the median is reported).")
flags.DEFINE_integer("step_tokens", 128, "Tokens of the real `ar` generation whose step is timed.")
flags.DEFINE_list("peers", [], "llamacpp: also time llama.cpp's forward of w tokens (launch/peers.py).")
flags.DEFINE_string("llamacpp_gguf", None, "The GGUF llama.cpp runs (default: the model's own).")
flags.DEFINE_enum("llamacpp_cache", "f16", list(peers.LLAMACPP_CACHES), "What llama.cpp's KV cache stores: f16 "
                  "(llama.cpp's default) or f32 (the precision of ours).")
flags.DEFINE_bool("xla_profile", False, "Also split each forward by XLA's profiler (launch/xla_profile.py).")
flags.DEFINE_string("out", "step_cost.json", "JSON record; the table goes to OUT.md.")
FLAGS = flags.FLAGS


def median_ms(fn, *args, repeats: int) -> float:
  from hitree_jax.decode.timing import median_seconds
  return 1e3 * median_seconds(fn, *args, repeats=repeats)


def part_programs(config, sampling):
  """Jitted parts of a step; each takes only arrays (the config is closed over)."""
  import jax
  import jax.numpy as jnp
  from hitree_jax.decode.programs import ahead_of_time
  from hitree_jax.decode.drafters import round_attend
  from hitree_jax.decode.sampling import draw, probabilities
  from hitree_jax.decode.sizes import MIN_RECENT_SLOTS as RECENT_SLOTS   # an `ar` block's recent cache
  from hitree_jax.decode.verify import verify
  from hitree_jax.model.llama import forward, hidden_states, logits_from_hidden
  from hitree_jax.tree.shapes import chain

  def attend(recent, width):
    return round_attend(recent.lengths, RECENT_SLOTS, jnp.tril(jnp.ones((width, width), bool)))

  def positions(long, width):
    return long.lengths[:, None] + jnp.arange(width)[None, :]

  @jax.jit
  def full_forward(params, tokens, recent, long):
    logits, _, recent = forward(params, config, tokens, positions(long, tokens.shape[1]), recent,
                                attend(recent, tokens.shape[1]), context=(long,))
    return logits, recent

  @jax.jit
  def layers(params, tokens, recent, long):
    hidden, recent = hidden_states(params, config, tokens, positions(long, tokens.shape[1]), recent,
                                   attend(recent, tokens.shape[1]))
    return hidden, recent

  @jax.jit
  def head(params, hidden):
    return logits_from_hidden(params, config, hidden)

  @jax.jit
  def sample_all(key, logits):
    return draw(key, probabilities(logits, sampling))

  def verify_chain(width):
    tree = chain(width - 1)

    @jax.jit
    def run(key, tokens, logits):
      probs = probabilities(logits, sampling)
      return verify(key, tree, tokens[:, 1:], probs, probs, "iid").n_accepted
    return run

  return tuple(map(ahead_of_time, (full_forward, layers, head, sample_all))) + (
      lambda width: ahead_of_time(verify_chain(width)),)


def context_row(model, ids, widths, sampling, programs, peer, progress) -> dict:
  import jax
  import jax.numpy as jnp
  from hitree_jax.cache.full import KVCache
  from hitree_jax.decode import engine, prefill as prefill_lib
  from hitree_jax.decode.sizes import MIN_RECENT_SLOTS as RECENT_SLOTS

  config, params = model.config, model.params
  batch = prefill_lib.make_batch([ids], config, FLAGS.step_tokens)
  slots = prefill_lib.cache_slots(len(ids), FLAGS.step_tokens, extra=RECENT_SLOTS)
  _, long = prefill_lib.prefill(params, config, KVCache.init(config, 1, slots), batch, programs)
  full_forward, layers, head, sample_all, verify_chain = part_programs(config, sampling)
  key = jax.random.key(FLAGS.seed)
  row = {"prompt_tokens": len(ids), "cache_slots": slots, "widths": {}}
  for w in widths:
    tokens = jnp.asarray([ids[-w:]], jnp.int32)
    recent = KVCache.init(config, 1, RECENT_SLOTS)
    logits, _ = full_forward(params, tokens, recent, long)
    hidden, _ = layers(params, tokens, recent, long)
    part = {"forward_ms": median_ms(full_forward, params, tokens, recent, long, repeats=FLAGS.repeats),
            "layers_ms": median_ms(layers, params, tokens, recent, long, repeats=FLAGS.repeats),
            "head_ms": median_ms(head, params, hidden, repeats=FLAGS.repeats),
            "sampling_ms": median_ms(sample_all, key, logits, repeats=FLAGS.repeats)}
    part["attention_ms"] = part["forward_ms"] - part["layers_ms"] - part["head_ms"]
    if w > 1:
      part["verify_ms"] = median_ms(verify_chain(w), key, tokens, logits, repeats=FLAGS.repeats)
    if FLAGS.xla_profile:
      from . import xla_profile
      part["profile"] = xla_profile.breakdown(full_forward, params, tokens, recent, long, repeats=FLAGS.repeats,
                                               wall_s=part["forward_ms"] / 1e3)  # roles add up to it
    if peer is not None:
      part["llamacpp_forward_ms"] = peer.forward_ms(ids, w, FLAGS.repeats)
    row["widths"][w] = part
    progress.step(detail=f"P={len(ids)} w={w}: forward {part['forward_ms']:.1f} ms")
  result = engine.generate(params, config, [ids], max_new_tokens=FLAGS.step_tokens, sampling=sampling,
                           seed=FLAGS.seed, stop_at_eos=False, programs=programs)
  row["step_ms"] = 1e3 / result.decode_tokens_per_s
  progress.step(detail=f"P={len(ids)} ar step {row['step_ms']:.1f} ms")
  one = row["widths"][1] if 1 in row["widths"] else None
  if one:
    row["loop_ms"] = row["step_ms"] - one["forward_ms"] - one["sampling_ms"]
  return row


def markdown(rows) -> str:
  fmt = lambda x: "–" if x is None else f"{x:.1f}"
  lines = ["| prompt tokens | `ar` step ms | 1-token forward | layers | head | attention | sampling | loop |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    one = r["widths"].get(1, {})
    lines.append(f"| {r['prompt_tokens']} | {fmt(r['step_ms'])} | {fmt(one.get('forward_ms'))} | "
                 f"{fmt(one.get('layers_ms'))} | {fmt(one.get('head_ms'))} | {fmt(one.get('attention_ms'))} | "
                 f"{fmt(one.get('sampling_ms'))} | {fmt(r.get('loop_ms'))} |")
  with_peer = any("llamacpp_forward_ms" in p for r in rows for p in r["widths"].values())
  lines += ["", "| prompt tokens | tokens per forward | forward ms | x 1-token | verify ms |"
            + (" llama.cpp ms | llama.cpp x 1-token |" if with_peer else ""),
            "|---|---|---|---|---|" + ("---|---|" if with_peer else "")]
  for r in rows:
    base = r["widths"].get(1, {})
    for w, p in r["widths"].items():
      ratio = p["forward_ms"] / base["forward_ms"] if base else None
      line = f"| {r['prompt_tokens']} | {w} | {fmt(p['forward_ms'])} | {fmt(ratio)} | {fmt(p.get('verify_ms'))} |"
      if with_peer:
        theirs = p.get("llamacpp_forward_ms")
        their_ratio = theirs / base["llamacpp_forward_ms"] if theirs and base else None
        line += f" {fmt(theirs)} | {fmt(their_ratio)} |"
      lines.append(line)
  if any("profile" in p for r in rows for p in r["widths"].values()):
    lines += ["", "By XLA's profiler (ms per forward; GB/s: the weights' bytes / their products' time):", "",
              "| prompt tokens | tokens per forward | forward ms | weights | head | attention | other ops "
              "| runtime | ops | weights GB/s | head GB/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      for w, p in r["widths"].items():
        if "profile" in p:
          q = p["profile"]
          lines.append(f"| {r['prompt_tokens']} | {w} | {fmt(p['forward_ms'])} | {fmt(q['weights_ms'])} | "
                       f"{fmt(q['head_ms'])} | {fmt(q['attention_ms'])} | {fmt(q['other_ms'])} | "
                       f"{fmt(q['runtime_ms'])} | {q['ops']:.0f} | {fmt(q['weights_gb_per_s'])} | "
                       f"{fmt(q['head_gb_per_s'])} |")
  return "\n".join(lines)


def main(argv):
  del argv
  try:
    lengths = [int(n) for n in FLAGS.prompt_tokens]
    widths = [int(w) for w in FLAGS.widths]
  except ValueError:
    raise UsageError(f"--prompt_tokens={','.join(FLAGS.prompt_tokens)} and --widths={','.join(FLAGS.widths)} "
                     "must be comma-separated integers") from None
  if min(lengths) < 16 or min(widths) < 1 or FLAGS.repeats < 1:
    raise UsageError("--prompt_tokens must be >= 16, --widths and --repeats >= 1")
  if set(FLAGS.peers) - {"llamacpp"}:
    raise UsageError(f"--peers={','.join(FLAGS.peers)}: step_cost times llamacpp only")
  peers.check(FLAGS.peers, [FLAGS.llamacpp_gguf] if FLAGS.llamacpp_gguf else [])
  sampling = common.sampling_from_flags(FLAGS)
  import jax
  from hitree_jax.data import book_prompts
  from hitree_jax.decode.programs import Programs
  from hitree_jax.loading import load_model
  from hitree_jax.tokenizer import load_tokenizer
  from .progress import Progress

  model = load_model(FLAGS.model, common.model_dtype(), FLAGS.key_dtype)
  tokenizer = load_tokenizer(model.path)
  peer = (peers.make_peer("llamacpp", model.path, FLAGS.llamacpp_gguf,
                          max(lengths) + max(widths) + 16, FLAGS.llamacpp_cache) if FLAGS.peers else None)
  rows = []
  progress = Progress("step_cost", len(lengths) * (len(widths) + 1))
  for n in lengths:
    ids = book_prompts(tokenizer, n, 1)[0]
    rows.append(context_row(model, ids, widths, sampling, Programs(), peer, progress))
    jax.clear_caches()
  out = pathlib.Path(FLAGS.out)
  from hitree_jax import provenance
  record = {**provenance.stamp(), "model": FLAGS.model, "dtype": common.model_dtype(), "key_dtype": FLAGS.key_dtype, "temperature": FLAGS.temperature,
            "top_p": FLAGS.top_p, "top_k": FLAGS.top_k, "repeats": FLAGS.repeats,
            "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "llamacpp": None if peer is None else peer.label, "rows": rows}
  out.write_text(json.dumps(record, indent=2))
  table = markdown(rows)
  out.with_suffix(".md").write_text(table + "\n")
  print(table)


def run():
  common.run(main)


if __name__ == "__main__":
  run()
