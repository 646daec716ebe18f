"""Spec-Bench's questions as shipped, and the selection a benchmark run makes of them."""

import collections
import hashlib
import json

import pytest

from hitree_jax import spec_bench


def test_the_shipped_file_is_spec_benchs_480_questions_unchanged():
  data = spec_bench.QUESTIONS.read_bytes()
  # the SHA-256 that data/spec_bench/README.md gives for hemingkx/Spec-Bench at fd2c1cd
  assert hashlib.sha256(data).hexdigest() == "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
  questions = spec_bench.read()
  assert len(questions) == 480 and len({q.question_id for q in questions}) == 480
  assert collections.Counter(q.task for q in questions) == {task: 80 for task in spec_bench.TASKS}
  assert {len(q.turns) for q in questions if q.task == "mt_bench"} == {2}
  assert {len(q.turns) for q in questions if q.task != "mt_bench"} == {1}
  assert collections.Counter(q.category for q in questions if q.task == "mt_bench") == {
      c: 10 for c in spec_bench.MT_BENCH}


def test_select_by_task_or_category_and_per_category_in_file_order():
  questions = spec_bench.read()
  two = spec_bench.select(questions, ["mt_bench", "rag"], per_category=2)
  assert [q.task for q in two] == ["mt_bench", "mt_bench", "rag", "rag"]
  assert [q.question_id for q in two] == sorted(q.question_id for q in two)
  coding = spec_bench.select(questions, ["coding"])
  assert len(coding) == 10 and {q.category for q in coding} == {"coding"}
  every = spec_bench.select(questions, per_category=1)
  assert [q.task for q in every] == list(spec_bench.TASKS)
  with pytest.raises(ValueError, match="--categories: poetry not among"):
    spec_bench.select(questions, ["poetry"])
  with pytest.raises(ValueError, match="--per_category=0 must be >= 1"):
    spec_bench.select(questions, per_category=0)


def test_a_users_file_in_the_same_format_and_bad_ones_are_named(tmp_path):
  mine = tmp_path / "mine.jsonl"
  mine.write_text("\n".join(json.dumps(r) for r in (
      {"question_id": 1, "category": "qa", "turns": ["What is 2 + 2?"]},
      {"question_id": 2, "category": "chat", "turns": ["Hi.", "And then?"]})) + "\n")
  got = spec_bench.read(mine)
  assert [(q.question_id, q.task, q.turns) for q in got] == [(1, "qa", ("What is 2 + 2?",)),
                                                            (2, "chat", ("Hi.", "And then?"))]
  mine.write_text('{"question_id": 1, "category": "qa", "turns": []}\n')
  with pytest.raises(ValueError, match=f"--questions={mine}: line 1 is not a question"):
    spec_bench.read(mine)
  with pytest.raises(ValueError, match="no such file"):
    spec_bench.read(tmp_path / "absent.jsonl")


# ---- chat training text (launch.distill --text=chat): never Spec-Bench's questions ----

@pytest.fixture(scope="module")
def tokenizer():
  from hitree_jax.loading import resolve
  from hitree_jax.tokenizer import load_tokenizer
  return load_tokenizer(resolve("smollm2"))


def chat_recipe():
  from hitree_jax import shipped
  return shipped.config("distill_eagle_chat")


@pytest.mark.slow
def test_chat_windows_are_instructions_over_book_passages_of_one_length(tokenizer):
  from hitree_jax.train import instructions
  windows, texts = instructions.chat_windows(tokenizer, "train", 96, 12, 72)
  assert windows.shape == (12, 96) and not windows[:, 72:].any()   # the teacher writes the rest
  for i, (row, text) in enumerate(zip(windows, texts)):
    prompt = tokenizer.decode(row[:72].tolist())
    assert text.startswith(instructions.TASKS[i % len(instructions.TASKS)] + "\n\n")   # tasks take turns
    assert text in prompt and prompt.endswith("<|im_start|>assistant\n")             # the chat template
    assert row[:72].tolist() == instructions.chat_prompt(tokenizer, text)
  held_out, _ = instructions.chat_windows(tokenizer, "eval", 96, 2, 72)
  persuasion = (instructions.corpus.split_texts("eval")["austen"])
  assert tokenizer.decode(held_out[0, :72].tolist()).split("\n\n", 2)[-1][:40] in persuasion
  with pytest.raises(ValueError, match="--own_prompt_tokens=40 must leave at least 16 passage tokens"):
    instructions.chat_windows(tokenizer, "train", 96, 2, 40)


@pytest.mark.slow
def test_no_training_instruction_shares_13_words_with_a_spec_bench_question(tokenizer):
  """The chat recipe's training and held-out instructions, and the chat profile's open ones,
  against all 480 questions' turns; and a negative control: a question copied into a passage is caught."""
  from hitree_jax.train import instructions
  recipe = chat_recipe()
  turns = [turn for q in spec_bench.read() for turn in q.turns]
  for split, n in (("train", recipe.train_windows), ("eval", recipe.eval_windows)):
    _, texts = instructions.chat_windows(tokenizer, split, recipe.window, n, recipe.own_prompt_tokens)
    assert len(texts) == n and instructions.overlap(texts, turns) == set()
  assert instructions.overlap(instructions.OPEN_INSTRUCTIONS, turns) == set()   # the chat profile's
  planted = texts[0] + " " + turns[123]
  assert instructions.overlap([planted], turns) == instructions.shingles(turns[123])


# The exactness check: a method that parts from `ar` is named, with how near a tie it parted at.

def _tiny_target():
  import jax
  from hitree_jax.model.config import ModelConfig
  from hitree_jax.model.llama import init_params
  config = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=128, eos_token_id=None,
                       tie_word_embeddings=False)
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, init_params(config, jax.random.key(3)))
  return config, params


PROMPT = [3, 5, 7, 11, 13, 17, 19, 3, 5]


def test_top2_margins_are_zero_exactly_where_the_target_ties_two_tokens():
  import numpy as np
  from hitree_jax.decode import engine
  from hitree_jax.near_ties import top2_margins
  config, params = _tiny_target()
  answer = engine.generate(params, config, [PROMPT], max_new_tokens=24).tokens[0]
  margins = top2_margins(params, config, PROMPT, answer)
  assert margins.shape == (len(answer) + 1,) and (margins > 1e-3).all()
  # Give token `tied` the output column of the answer's commonest token: a tie wherever that wins.
  common = max(set(answer), key=answer.count)
  tied = next(t for t in range(config.vocab_size) if t not in answer)
  kernel = params["lm_head"]["kernel"]
  params = {**params, "lm_head": {"kernel": kernel.at[:, tied].set(kernel[:, common])}}
  margins = top2_margins(params, config, PROMPT, answer)
  wins = np.asarray(answer) == common
  assert wins.sum() >= 2 and (margins[:-1][wins] < 1e-5).all() and (margins[:-1][~wins] > 1e-3).all()


def _runs(tokens, prompt=PROMPT):
  turn = {"prompt": prompt, "tokens": tokens, "new_tokens": len(tokens), "decode_s": 1.0, "rows": 1,
          "prefill_s": 0.1, "target_forwards": len(tokens), "compiles": 0}
  return [{"question_id": 7, "task": "qa", "category": "qa", "turns": [turn]}]


def test_a_near_ties_line_is_its_precisions():
  from hitree_jax.model.config import ModelConfig
  from hitree_jax.near_ties import TIE_MARGINS, tie_margin
  config = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8)
  assert tie_margin(config) == TIE_MARGINS["float32"] < TIE_MARGINS["bfloat16"]
  assert tie_margin(config.replace(key_dtype="bfloat16")) == tie_margin(config.replace(dtype="bfloat16")) \
      == TIE_MARGINS["bfloat16"]


def test_a_biased_method_is_caught_with_the_targets_margin_where_it_parts():
  """A negative control: a method whose token at one position is not the target's argmax is
  named, with the question, turn, position and the target's (wide) margin there; an answer that
  runs on past `ar`'s end parts where `ar`'s ended."""
  import numpy as np
  from hitree_jax.decode import engine
  from hitree_jax.near_ties import top2_margins
  from launch import spec_bench_run
  config, params = _tiny_target()
  ar = engine.generate(params, config, [PROMPT], max_new_tokens=20).tokens[0]
  biased = ar[:11] + [(ar[11] + 1) % config.vocab_size] + ar[12:]
  margins_of = lambda prompt, answer: top2_margins(params, config, prompt, answer)
  by_method = {(m, 1): runs for m, runs in
               {"ar": _runs(ar), "same": _runs(list(ar)), "biased": _runs(biased), "longer": _runs(ar + [1])}.items()}
  results = {r["method"]: r for r in spec_bench_run.rows(by_method, True, margins_of)}
  assert results["same"]["differs_from_ar"] == []
  margins = margins_of(PROMPT, ar)
  [parted] = results["biased"]["differs_from_ar"]
  assert (parted["question_id"], parted["turn"], parted["at"]) == (7, 1, 11)
  assert parted["margin"] == margins[11] > 1e-3
  assert parted["smaller_in_answer"] == int((margins < margins[11]).sum())
  assert parted["median_margin"] == float(np.median(margins))
  [ran_on] = results["longer"]["differs_from_ar"]
  assert ran_on["at"] == len(ar) and ran_on["margin"] == margins[len(ar)]
  line = spec_bench_run.parting_line("biased", parted)
  assert line.startswith("biased: question 7 turn 1 differs from ar at token 11: the target's top-2")
  table = spec_bench_run.markdown(list(results.values()))
  assert "| same |" in table and f"no: 1 turns, at top-2 logit margins of at most {margins[11]:.4f} |" in table
  # Judged against a near-tie's line: wider is a fault, and the run's one line names it.
  from hitree_jax import near_ties
  two = {(m, 1): by_method[m, 1] for m in ("ar", "biased")}
  for tie, fault in ((margins[11] / 2, True), (margins[11], False)):
    judged = {r["method"]: r for r in spec_bench_run.rows(two, True, margins_of, tie)}
    assert judged["biased"]["differs_from_ar"][0]["near_tie"] is not fault
    message = near_ties.fault_message(list(judged.values()), tie, lambda d: f"question {d['question_id']}")
    assert (message is not None) == fault
  assert message is None and ", a near-tie" in spec_bench_run.parting_line("biased", judged["biased"]["differs_from_ar"][0])
  judged = spec_bench_run.rows(two, True, margins_of, margins[11] / 2)
  message = near_ties.fault_message(judged, margins[11] / 2, lambda d: f"question {d['question_id']}")
  assert message.startswith("1 greedy runs parted from ar at a top-2 logit margin wider than a near-tie")
  assert "the first: biased: question 7 differs from ar at token 11" in message
  assert message.endswith("wider than a near-tie: not rounding")
  # Without a model to ask, the parting is still named.
  plain = spec_bench_run.rows(by_method, True)
  assert [r["differs_from_ar"] for r in plain if r["method"] == "biased"] == [[{"question_id": 7, "turn": 1, "at": 11}]]


def test_a_turn_after_a_parting_is_not_compared_with_ars():
  """A second turn asked after a first that parted from `ar` has another prompt (the run's own
  first answer): its tokens are not `ar`'s to match, so only the first turn is named."""
  from launch import spec_bench_run
  def question(first, second):
    turn = lambda prompt, tokens: {"prompt": prompt, "tokens": tokens, "new_tokens": len(tokens), "decode_s": 1.0,
                                   "rows": 1, "prefill_s": 0.1, "target_forwards": len(tokens), "compiles": 0}
    return [{"question_id": 81, "task": "mt_bench", "category": "writing",
             "turns": [turn(PROMPT, first), turn(PROMPT + first + [5], second)]}]
  by_run = {("ar", 1): question([1, 2, 3], [4, 5]), ("sd", 1): question([1, 2, 9], [7, 7]),
            ("tree", 1): question([1, 2, 3], [4, 6])}
  results = {r["method"]: r for r in spec_bench_run.rows(by_run, True)}
  assert results["sd"]["differs_from_ar"] == [{"question_id": 81, "turn": 1, "at": 2}]
  assert results["tree"]["differs_from_ar"] == [{"question_id": 81, "turn": 2, "at": 1}]


def test_a_batchs_seconds_count_once_and_its_speedup_is_over_ar_at_that_size():
  """Two questions decoded together in 2 s: 20 tokens over 2 s, not over 4; the speedup is over
  `ar` at batch 2; a row's latency is its batch's time; rows are compared with `ar` alone."""
  from launch import spec_bench_run
  def runs(seconds, rows, tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)):
    turn = lambda: {"prompt": PROMPT, "tokens": list(tokens), "new_tokens": len(tokens), "decode_s": seconds,
                    "rows": rows, "prefill_s": 0.1, "target_forwards": 5, "compiles": 0}
    return [{"question_id": q, "task": "qa", "category": "qa", "turns": [turn()]} for q in (1, 2)]
  by_run = {("ar", 1): runs(1.0, 1), ("ar", 2): runs(1.6, 2), ("sd", 2): runs(0.8, 2, (1, 2, 3, 4, 5, 6, 7, 8, 9, 11))}
  results = {(r["method"], r["batch_size"]): r for r in spec_bench_run.rows(by_run, True)}
  assert results["ar", 1]["overall"]["tokens_per_s"] == 10.0
  assert results["ar", 2]["overall"]["tokens_per_s"] == 20 / 1.6 and results["ar", 2]["overall"]["median_row_latency_s"] == 1.6
  assert results["sd", 2]["overall"]["speedup"] == 2.0 and results["sd", 2]["overall"]["tau"] == 2.0
  assert results["ar", 2]["differs_from_ar"] == [] and "differs_from_ar" not in results["ar", 1]
  assert [d["at"] for d in results["sd", 2]["differs_from_ar"]] == [9, 9]
  table = spec_bench_run.markdown(list(results.values()))
  assert "| sd | 2 | 2.00x | 2.00x | 2.00 | 25.00 | 0.80 | no: 2 turns |" in table
  assert spec_bench_run.name(results["sd", 2]) == "sd x2"
