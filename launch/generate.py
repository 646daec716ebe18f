"""Generate text with a Llama-family model.

  python -m launch.generate --model=smollm2 --book=austen --prompt_tokens=512 \
      --max_new_tokens=128 --temperature=0.6 --top_p=0.9
  python -m launch.generate --prompt="Write a haiku about rain." --chat --json
  python -m launch.generate --book=austen --method=tree --draft=self:8 --tree=kary:2x2

With --json the last line printed is one JSON object (ids, text, timings).
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import flags

from hitree_jax import methods
from hitree_jax.errors import NotFound, UsageError
from . import common

common.define_config_flag()
common.define_model_flags()
common.define_sampling_flags()
common.define_mesh_flags()
common.define_speculation_flags()
flags.DEFINE_string("prompt", None, "Prompt text.")
flags.DEFINE_string("prompt_file", None, "File holding the prompt text.")
flags.DEFINE_enum("book", None, ["austen", "shakespeare", "milton"],
                  "Use a passage of this book corpus as the prompt (see --prompt_tokens).")
flags.DEFINE_integer("prompt_tokens", 512, "Length of the --book passage, in tokens.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate at most.")
flags.DEFINE_string("method", "ar", f"Decoding method; one of {methods.METHODS + ('auto',)}. sd: a chain of "
                    "--gamma draft tokens; tree: --tree; both use --draft. retrieval: the target "
                    "over a --budget retrieval cache drafts for itself. triforce / hitree: --draft "
                    "(StreamingLLM cache) -> the target's retrieval level -> the target. hsd: any "
                    "stack, --levels (docs/methods.md). auto: the stack launch.plan chooses around "
                    "--draft=PATH for this prompt's length and sampling (profiled on first use).")
flags.DEFINE_bool("chat", False, "Wrap the prompt in the model's chat template.")
flags.DEFINE_bool("ignore_eos", False, "Keep generating after the end-of-sequence token.")
flags.DEFINE_bool("json", False, "Print one JSON record as the last line.")
FLAGS = flags.FLAGS


def check_prompt_flags() -> None:
  """Fails fast, before the slow model load, on a bad prompt source."""
  given = [n for n in ("prompt", "prompt_file", "book") if getattr(FLAGS, n) is not None]
  if len(given) != 1:
    raise UsageError(f"give exactly one of --prompt, --prompt_file, --book (got {given or 'none'})")
  if FLAGS.prompt == "" or (FLAGS.prompt_file and not prompt_file_text()):
    raise UsageError("the prompt is empty")
  if FLAGS.book and FLAGS.chat:
    raise UsageError("--chat does not apply to --book passages")
  if FLAGS.book and FLAGS.prompt_tokens < 1:
    raise UsageError(f"--prompt_tokens={FLAGS.prompt_tokens} must be >= 1")


def prompt_file_text() -> str:
  """--prompt_file's text, or an error naming the flag and the file: absent, or not UTF-8."""
  path = pathlib.Path(FLAGS.prompt_file)
  if not path.is_file():
    raise NotFound(f"--prompt_file={path}: no such file")
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise UsageError(f"--prompt_file={path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def profile_text() -> str:
  """The kind of text the planner profiles for this prompt: chat, or the book (Austen's for a
  plain prompt)."""
  return "chat" if FLAGS.chat else FLAGS.book or "austen"


def prompt_ids(tokenizer) -> list[int]:
  if FLAGS.book:
    from hitree_jax.data import book_prompts
    return book_prompts(tokenizer, FLAGS.prompt_tokens, 1, corpus=FLAGS.book)[0]
  text = prompt_file_text() if FLAGS.prompt_file else FLAGS.prompt
  if FLAGS.chat:
    from hitree_jax.tokenizer import chat_prompt
    return chat_prompt(tokenizer, text)
  return tokenizer.encode(text, add_special_tokens=False)


def check_prompt(ids: list[int], config, draft_config, is_draft_alone: bool) -> None:
  """The prompt must fit the target's context, and the draft's, with the tokens asked for."""
  from hitree_jax.decode.prefill import make_batch
  if not ids:
    raise UsageError("the prompt is empty (0 tokens)")
  if not is_draft_alone:
    make_batch([ids], config, FLAGS.max_new_tokens)
  for name, c in (("the draft", draft_config), ("the model", config if is_draft_alone else None)):
    if c is not None and len(ids) + FLAGS.max_new_tokens > c.max_position_embeddings:
      raise UsageError(f"the prompt has {len(ids)} tokens; with --max_new_tokens="
                       f"{FLAGS.max_new_tokens} that is {len(ids) + FLAGS.max_new_tokens} > "
                       f"{name}'s context of {c.max_position_embeddings}")


def main(argv):
  del argv
  mesh = common.mesh_from_flags(FLAGS)  # first: a multi-host run joins before jax starts
  common.check_method_flags(FLAGS.method.partition("/")[0], common.given_flags())
  planned = FLAGS.method == "auto"  # the stack is chosen once the prompt's length is known
  if planned:
    methods.check_auto_draft(FLAGS.draft, FLAGS.feature_draft)
  else:
    method = methods.parse_method(FLAGS.method, common.knobs_from_flags(FLAGS), FLAGS.temperature == 0)
  check_prompt_flags()
  sampling = common.sampling_from_flags(FLAGS)
  if FLAGS.max_new_tokens < 1:
    raise UsageError(f"--max_new_tokens={FLAGS.max_new_tokens} must be >= 1")
  from hitree_jax import sharding
  from hitree_jax.loading import load_config, load_model, load_vocab, resolve
  from hitree_jax.tokenizer import load_tokenizer

  # Everything a user can get wrong is checked from metadata, before the slow weight load.
  config = load_config(FLAGS.model, common.model_dtype(), FLAGS.key_dtype)
  tokenizer = load_tokenizer(resolve(FLAGS.model))
  ids = prompt_ids(tokenizer)
  if planned:  # any stack with the draft: its checks (tokenizer, vocabulary) before the slow loads
    method = methods.parse_method("hsd/draft/chain:1", methods.Knobs(draft=FLAGS.draft), True)
  draft_config = method.check_draft(config, tokenizer)
  is_draft_alone = load_vocab(FLAGS.model) is not None
  if is_draft_alone and method.name != "ar":
    raise UsageError(f"--model={FLAGS.model} has a reduced vocabulary (a draft): "
                     "it can run --method=ar, or serve as --draft of its target")
  check_prompt(ids, config, draft_config, is_draft_alone)

  model = load_model(FLAGS.model, common.model_dtype(), FLAGS.key_dtype)
  sharding.check(model.config, mesh, 1, 256)  # before the draft loads; generate checks the cache's slots
  if planned:
    method = methods.auto_method(FLAGS.model, FLAGS.draft, len(ids), sampling, loaded=(model, None),
                                feature_draft=FLAGS.feature_draft, text=profile_text())
  else:
    import jax
    advice = methods.preset_advice(method, FLAGS.model, len(ids), sampling, model.config.dtype,
                                   FLAGS.key_dtype, on_cpu=jax.default_backend() == "cpu",
                                   text=profile_text())
    if advice:
      print(f"note: {advice}", file=sys.stderr)
  method = method.load_draft(model.config, model.params)
  model_ids = ids if model.vocab is None else model.vocab.to_draft(ids).tolist()  # a draft alone
  result = method.generate(sharding.place_params(model.params, mesh), model.config, [model_ids],
                           max_new_tokens=FLAGS.max_new_tokens, sampling=sampling, seed=FLAGS.seed,
                           stop_at_eos=not FLAGS.ignore_eos, mesh=mesh)
  tokens = result.tokens[0] if model.vocab is None else model.vocab.to_target(result.tokens[0]).tolist()
  text = tokenizer.decode(tokens, skip_special_tokens=True)
  print(text)
  spec = f", {result.mean_accepted:.2f} tokens per target forward" if result.mean_accepted else ""
  if result.levels and len(result.levels) > 1:
    spec += "; acceptance per level " + ", ".join(
        f"{level['name']} {level['acceptance']:.2f}" for level in result.levels if level["proposed"])
  compiled = (f"compile {result.compile_s:.1f} s ({result.compiles} compiled, "
              f"{result.cache_loads} from the compilation cache)")
  print(f"\n[{method.label}] prompt {len(ids)} tokens, generated {len(tokens)}: "
        f"prefill {result.prefill_s:.2f} s, decode {result.decode_s:.2f} s "
        f"({result.decode_tokens_per_s:.1f} tok/s{spec}), {compiled}",
        file=sys.stderr if FLAGS.json else sys.stdout)
  if FLAGS.json:
    print(json.dumps({
        "model": FLAGS.model, "method": method.label, "prompt_ids": ids, "tokens": tokens,
        "text": text, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
        "decode_tokens_per_s": result.decode_tokens_per_s, "compile_s": result.compile_s,
        "compiles": result.compiles, "cache_loads": result.cache_loads,
        "temperature": FLAGS.temperature, "top_p": FLAGS.top_p, "top_k": FLAGS.top_k,
        "seed": FLAGS.seed, "target_forwards": result.target_forwards,
        "mean_accepted": result.mean_accepted, "accepted_per_depth": result.accepted_per_depth,
        "levels": result.levels, "mesh": sharding.describe(mesh),
        "settings": common.launcher_settings()}))


def run():
  common.run(main)


if __name__ == "__main__":
  run()
