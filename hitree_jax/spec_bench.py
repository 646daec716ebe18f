"""Spec-Bench's questions (data/spec_bench/question.jsonl), or any file in its format.

Spec-Bench (hemingkx/Spec-Bench, Apache-2.0) is the speculative-decoding field's shared
workload: chat prompts to an instruct model in six tasks. The 80 MT-bench questions have two
turns and eight sub-categories, which Spec-Bench reports together as one task, `mt_bench`. The
other five tasks are translation, summarization, qa, math_reasoning and rag, with 80 single-turn
questions each. A row is {"question_id": int, "category": str, "turns": [str, ...]}.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

from hitree_jax import shipped
from hitree_jax.errors import UsageError

QUESTIONS = shipped.find("spec_bench/question.jsonl", "data")
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: int
  category: str             # as in the file (an MT-bench sub-category for mt_bench's)
  turns: tuple[str, ...]    # the user's turns, in order

  @property
  def task(self) -> str:
    """What Spec-Bench reports it under: `mt_bench` for MT-bench's sub-categories."""
    return "mt_bench" if self.category in MT_BENCH else self.category


def read(path: str | pathlib.Path | None = None) -> list[Question]:
  """The questions of a Spec-Bench-format file (default: Spec-Bench's own), in file order.
  Raises ValueError naming the file and the line that is not a question."""
  path = pathlib.Path(path) if path is not None else QUESTIONS
  if not path.is_file():
    raise UsageError(f"--questions={path}: no such file (a JSONL of question_id, category and turns)")
  questions = []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      turns = row["turns"]
      if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
        raise UsageError("'turns' must be a non-empty list of non-empty strings")
      questions.append(Question(int(row["question_id"]), str(row["category"]), tuple(turns)))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
      raise UsageError(f"--questions={path}: line {number} is not a question "
                       f"(question_id, category, turns): {error}") from None
  if not questions:
    raise UsageError(f"--questions={path}: holds no questions")
  return questions


def select(questions: Sequence[Question], categories: Sequence[str] = (),
           per_category: int | None = None) -> list[Question]:
  """The questions of the named tasks or categories (all when none is named), at most
  `per_category` of each task, in file order. Raises ValueError naming an unknown category."""
  known = {q.task for q in questions} | {q.category for q in questions}
  unknown = [c for c in categories if c not in known]
  if unknown:
    raise UsageError(f"--categories: {', '.join(unknown)} not among {', '.join(sorted(known))}")
  if per_category is not None and per_category < 1:
    raise UsageError(f"--per_category={per_category} must be >= 1")
  chosen, taken = [], {}
  for q in questions:
    if categories and q.task not in categories and q.category not in categories:
      continue
    if per_category is not None and taken.get(q.task, 0) >= per_category:
      continue
    taken[q.task] = taken.get(q.task, 0) + 1
    chosen.append(q)
  return chosen
