"""Generate text with a Llama-family model.

  python -m launch.generate --model=smollm2 --text=austen --prompt_tokens=512 \
      --max_new_tokens=128 --temperature=0.6 --top_p=0.9
  python -m launch.generate --prompt="Write a haiku about rain." --text=chat --json
  python -m launch.generate --text=austen --method=tree --draft=self:8 --tree=kary:2x2
  python -m launch.generate --prompts_file=questions.jsonl --text=chat --batch_size=4 --method=sd --draft=ngram

--text names the kind of text: a book (austen, shakespeare, milton), whose passage of
--prompt_tokens is the prompt, or chat, which wraps --prompt (or each of a file's prompts) in the
model's chat template. A prompt without --text is plain text. --method=auto plans for that kind.

With --json the last line printed is one JSON object (ids, text, timings). --prompts_file holds
several prompts, one per line (or a .jsonl of {"prompt": ...}, where a prompt may span lines);
they are decoded --batch_size at a time, a row each, every row stopping at its own EOS, and each
row's answer is printed under its number (with --json: a `rows` list).
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import flags

from hitree_jax import methods
from hitree_jax.data import CHAT, CORPORA
from hitree_jax.errors import NotFound, UsageError
from . import common

common.define_config_flag()
common.define_model_flags()
common.define_sampling_flags()
common.define_mesh_flags()
common.define_cache_sizing_flag()
common.define_speculation_flags()
flags.DEFINE_string("prompt", None, "Prompt text.")
flags.DEFINE_string("prompt_file", None, "File holding the prompt text.")
flags.DEFINE_string("prompts_file", None, "File of several prompts: one per line, or a .jsonl of "
                    '{"prompt": TEXT} objects. Decoded --batch_size at a time, a row each.')
flags.DEFINE_integer("batch_size", 8, "With --prompts_file: prompts decoded together.")
common.define_text_flag(None, "The kind of text: a book (austen, shakespeare, milton): a passage of it is "
                        "the prompt (--prompt_tokens long); chat: the prompt is a user's turn, wrapped "
                        "in the model's chat template. Unset: the prompt is plain text.")
flags.DEFINE_integer("prompt_tokens", 512, "Length of a --text=BOOK passage, in tokens.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate at most.")
flags.DEFINE_string("method", "ar", f"Decoding method; one of {methods.METHODS + ('auto',)}. sd: a chain of "
                    "--gamma draft tokens; tree: --tree; both use --draft. retrieval: the target "
                    "over a --budget retrieval cache drafts for itself. triforce / hitree: --draft "
                    "(StreamingLLM cache) -> the target's retrieval level -> the target. hsd: any "
                    "stack, --levels (docs/methods.md). auto: the stack launch.plan chooses around "
                    "--draft=PATH (default: the model's shipped draft) for this prompt's length and "
                    "sampling (profiled on first use).")
flags.DEFINE_bool("ignore_eos", False, "Keep generating after the end-of-sequence token.")
flags.DEFINE_bool("json", False, "Print one JSON record as the last line.")
FLAGS = flags.FLAGS


def check_prompt_flags() -> None:
  """Fails fast, before the slow model load, on a bad prompt source."""
  given = [n for n in ("prompt", "prompt_file", "prompts_file") if getattr(FLAGS, n) is not None]
  if is_book() and given:
    raise UsageError(f"--text={FLAGS.text} makes a passage of the book the prompt; drop --{given[0]} "
                     "(or give --text=chat, or no --text, for a prompt of your own)")
  if not is_book() and len(given) != 1:
    raise UsageError(f"give exactly one of --prompt, --prompt_file, --prompts_file, or --text=BOOK for a "
                     f"book's passage (got {' '.join('--' + n for n in given) or 'none'})")
  if FLAGS.prompt == "" or (FLAGS.prompt_file and not prompt_file_text()):
    raise UsageError("the prompt is empty")
  if FLAGS.prompts_file:
    prompts_file_texts()
  if FLAGS.batch_size < 1:
    raise UsageError(f"--batch_size={FLAGS.batch_size} must be >= 1")
  if is_book() and FLAGS.prompt_tokens < 1:
    raise UsageError(f"--prompt_tokens={FLAGS.prompt_tokens} must be >= 1")


def prompt_file_text(flag: str = "prompt_file") -> str:
  """--prompt_file's text, or an error naming the flag and the file: absent, or not UTF-8."""
  path = pathlib.Path(getattr(FLAGS, flag))
  if not path.is_file():
    raise NotFound(f"--{flag}={path}: no such file")
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise UsageError(f"--{flag}={path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def prompts_file_texts() -> list[str]:
  """--prompts_file's prompts: its non-blank lines, or each line's "prompt" in a .jsonl; an error
  names the line that is not a prompt."""
  text, where = prompt_file_text("prompts_file"), f"--prompts_file={FLAGS.prompts_file}"
  lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
  if FLAGS.prompts_file.endswith(".jsonl"):
    prompts = []
    for n, line in lines:
      try:
        prompt = json.loads(line)["prompt"]
      except (ValueError, KeyError, TypeError):
        raise UsageError(f'{where}: line {n} is not a JSON object with a "prompt"') from None
      if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f'{where}: line {n}\'s "prompt" is not a non-empty string')
      prompts.append(prompt)
  else:
    prompts = [line for _, line in lines]
  if not prompts:
    raise UsageError(f"{where}: no prompts in it")
  return prompts


def is_book() -> bool:
  """Whether --text names a book, whose passage is the prompt."""
  return FLAGS.text in CORPORA


def profile_text() -> str:
  """The kind of text the planner profiles for this prompt: --text (Austen's for plain text)."""
  return FLAGS.text or "austen"


def prompt_ids(tokenizer) -> list[list[int]]:
  """Every prompt's token ids (one, unless --prompts_file)."""
  if is_book():
    from hitree_jax.data import book_prompts
    return book_prompts(tokenizer, FLAGS.prompt_tokens, 1, corpus=FLAGS.text)
  texts = (prompts_file_texts() if FLAGS.prompts_file else
           [prompt_file_text() if FLAGS.prompt_file else FLAGS.prompt])
  if FLAGS.text == CHAT:
    from hitree_jax.tokenizer import chat_prompt
    return [chat_prompt(tokenizer, text) for text in texts]
  return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


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
    if not FLAGS["draft"].present:   # the model's shipped draft, beside the stacks that need none
      FLAGS.draft = methods.default_auto_draft(FLAGS.model, profile_text())
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
  prompts = prompt_ids(tokenizer)
  longest = max(len(ids) for ids in prompts)
  if planned:  # any stack with the draft: its checks (tokenizer, vocabulary) before the slow loads
    method = methods.parse_method("hsd/draft/chain:1", methods.Knobs(draft=FLAGS.draft), True)
  draft_config = method.check_draft(config, tokenizer)
  is_draft_alone = load_vocab(FLAGS.model) is not None
  if is_draft_alone and method.name != "ar":
    raise UsageError(f"--model={FLAGS.model} has a reduced vocabulary (a draft): "
                     "it can run --method=ar, or serve as --draft of its target")
  for i, ids in enumerate(prompts):
    try:
      check_prompt(ids, config, draft_config, is_draft_alone)
    except UsageError as e:
      raise UsageError(f"--prompts_file prompt {i + 1}: {e}" if FLAGS.prompts_file else str(e)) from None

  model = load_model(FLAGS.model, common.model_dtype(), FLAGS.key_dtype)
  sharding.check(model.config, mesh, 1, 256)  # before the draft loads; generate checks the cache's slots
  if planned:  # planned for the longest prompt and a batch's rows
    method = methods.auto_method(FLAGS.model, FLAGS.draft, longest, sampling, loaded=(model, None),
                                feature_draft=FLAGS.feature_draft, text=profile_text(),
                                batch=min(FLAGS.batch_size, len(prompts)))
  else:
    import jax
    advice = methods.preset_advice(method, FLAGS.model, longest, sampling, model.config.dtype,
                                   FLAGS.key_dtype, on_cpu=jax.default_backend() == "cpu",
                                   text=profile_text())
    if advice:
      print(f"note: {advice}", file=sys.stderr)
  method = method.load_draft(model.config, model.params)
  params = sharding.place_params(model.params, mesh)
  rows, batches = [], []
  for first in range(0, len(prompts), FLAGS.batch_size):
    batch = prompts[first:first + FLAGS.batch_size]
    model_ids = batch if model.vocab is None else [model.vocab.to_draft(ids).tolist() for ids in batch]  # a draft alone
    result = method.generate(params, model.config, model_ids, max_new_tokens=FLAGS.max_new_tokens,
                             sampling=sampling, seed=FLAGS.seed, stop_at_eos=not FLAGS.ignore_eos, mesh=mesh,
                             size_caches_for=FLAGS.size_caches_for)
    for ids, out in zip(batch, result.tokens):
      tokens = out if model.vocab is None else model.vocab.to_target(out).tolist()
      rows.append({"prompt_ids": ids, "tokens": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True)})
      if FLAGS.prompts_file:
        print(f"--- {len(rows)} ---")
      print(rows[-1]["text"])
    print(summary_line(method, result, batch, rows[first:], first), file=sys.stderr if FLAGS.json else sys.stdout)
    batches.append(result)
  if FLAGS.json:
    print(json.dumps(json_record(method, rows, batches, mesh)))


def summary_line(method, result, batch, rows, first: int) -> str:
  """What a generation (one prompt, or a batch of --prompts_file's) cost: prefill, decode speed
  over its rows, tokens per target forward, compiles."""
  spec = f", {result.mean_accepted:.2f} tokens per target forward" if result.mean_accepted else ""
  if result.levels and len(result.levels) > 1:
    spec += "; acceptance per level " + ", ".join(
        f"{level['name']} {level['acceptance']:.2f}" for level in result.levels if level["proposed"])
  compiled = (f"compile {result.compile_s:.1f} s ({result.compiles} compiled, "
              f"{result.cache_loads} from the compilation cache)")
  generated = sum(len(r["tokens"]) for r in rows)
  what = (f"prompt {len(batch[0])} tokens" if not FLAGS.prompts_file else
          f"prompts {first + 1}-{first + len(batch)} of {min(map(len, batch))}-{max(map(len, batch))} tokens")
  return (f"\n[{method.label}] {what}, generated {generated}: prefill {result.prefill_s:.2f} s, "
          f"decode {result.decode_s:.2f} s ({result.decode_tokens_per_s:.1f} tok/s{spec}), {compiled}")


def json_record(method, rows: list[dict], batches: list, mesh) -> dict:
  """--json's record: one prompt's ids, tokens and timings; with --prompts_file, `rows` (each
  prompt's ids, tokens and text) and `batches` (each batch's timings and acceptance)."""
  from hitree_jax import sharding
  timings = lambda r: {
      "prefill_s": r.prefill_s, "decode_s": r.decode_s, "decode_tokens_per_s": r.decode_tokens_per_s,
      "compile_s": r.compile_s, "compiles": r.compiles, "cache_loads": r.cache_loads,
      "target_forwards": r.target_forwards, "mean_accepted": r.mean_accepted,
      "accepted_per_depth": r.accepted_per_depth, "levels": r.levels}
  shared = {"model": FLAGS.model, "method": method.label, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
            "top_k": FLAGS.top_k, "seed": FLAGS.seed, "mesh": sharding.describe(mesh),
            "settings": common.launcher_settings()}
  if FLAGS.prompts_file:
    return {**shared, "batch_size": FLAGS.batch_size, "rows": rows,
            "batches": [{"rows": len(r.tokens), "rounds_per_row": r.rounds_per_row, **timings(r)} for r in batches]}
  [row], [result] = rows, batches
  return {**shared, "prompt_ids": row["prompt_ids"], "tokens": row["tokens"], "text": row["text"], **timings(result)}


def run():
  common.run(main)


if __name__ == "__main__":
  run()
