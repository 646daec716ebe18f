"""Chat training text from the book corpora: instructions over passages, in the chat template.

A draft that proposes for a chat model meets the model's answers to instructions (Spec-Bench's
setting), which book windows do not teach it. Spec-Bench's questions are test data, so the
instructions here are built from the training books instead, one task per kind of answer the
benchmark asks for (summarise, continue, answer about, rewrite in other words, extract, ask and
answer): the passage is the context, the teacher writes the answer (launch.distill
--text=chat; EAGLE's recipe of having the target regenerate the responses). `overlap`
checks that no training prompt shares a 13-word run with a benchmark question.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from hitree_jax.errors import UsageError
from hitree_jax.tokenizer import chat_prompt
from hitree_jax.train import corpus

TASKS = (
    "Summarize the following passage in a few sentences.",
    "Continue this passage for another paragraph, in the same style.",
    "Read the passage below and answer: who appears in it, and what happens?",
    "Rewrite this passage in plain modern English.",
    "List the people, places and objects mentioned in this passage.",
    "Write two questions a reader might ask about this passage, and answer them.",
)
# Instructions with no text to work from, as half of Spec-Bench's tasks are (MT-bench, QA, math;
# summarization, RAG and translation hand the model a text): a chat profile is measured on these
# beside the passage tasks, so prompt lookup is not planned as if every answer copied its prompt.
OPEN_INSTRUCTIONS = (
    "Write a short poem about a walk by the sea in winter.",
    "What are three good ways to save money on groceries? Explain each briefly.",
    "A farmer has 17 sheep, buys 8 more and then sells 5. How many sheep does he have? "
    "Explain your reasoning step by step.",
    "Explain in simple terms why the sky looks blue during the day.",
    "Imagine you are a guide in an old castle. Greet your visitors and describe the first room.",
    "Who was the first person to walk on the Moon, and in which year did it happen?",
)
CANDIDATES_PER_WINDOW = 4   # passages tried per window: a few do not tokenize to the exact length


def instruction(task: int, passage: str) -> str:
  return f"{TASKS[task % len(TASKS)]}\n\n{passage}"


def chat_windows(tokenizer, split: str, window: int, n_windows: int, prompt_tokens: int
                 ) -> tuple[np.ndarray, list[str]]:
  """([n_windows, window] int32 whose first prompt_tokens are a chat-templated instruction over a
  passage of the split's books, the rest 0 for the teacher to fill; the instructions' text).

  Each prompt is exactly prompt_tokens long (the passage is cut to fit), so the teacher answers
  all of them in one batched program; the tasks take turns."""
  overheads = [len(chat_prompt(tokenizer, instruction(task, ""))) for task in range(len(TASKS))]
  if not max(overheads) + 16 <= prompt_tokens < window:
    raise UsageError(f"--own_prompt_tokens={prompt_tokens} must leave at least 16 passage tokens "
                     f"after the chat template's {max(overheads)} and be below --window={window}")
  # Neighbouring passages of one book: window i tries passages CANDIDATES_PER_WINDOW * i, ...
  passages = corpus.token_windows(tokenizer, split, prompt_tokens, CANDIDATES_PER_WINDOW * n_windows)
  windows, texts = np.zeros((n_windows, window), np.int32), []
  for i in range(n_windows):
    tried = passages[CANDIDATES_PER_WINDOW * i:CANDIDATES_PER_WINDOW * (i + 1)]
    keep = prompt_tokens - overheads[i % len(TASKS)]   # the passage tokens that fit, estimated
    found = next(filter(None, (_exact_prompt(tokenizer, i, p, prompt_tokens, keep) for p in tried)), None)
    if found is None:
      raise UsageError(f"no {split} passage near window {i} fits a chat prompt of exactly "
                       f"{prompt_tokens} tokens")
    windows[i, :prompt_tokens], text = found
    texts.append(text)
  return windows, texts


def _exact_prompt(tokenizer, task: int, passage: np.ndarray, prompt_tokens: int, estimate: int,
                  reach: int = 6):
  """(ids, text) of the instruction over a prefix of `passage` whose chat prompt is exactly
  prompt_tokens long, or None. Re-encoding a passage's text can merge or split tokens at its end,
  so prefixes a few tokens either side of the estimate are tried."""
  for keep in sorted(range(estimate - reach, estimate + reach + 1), key=lambda k: abs(k - estimate)):
    if not 16 <= keep <= len(passage):
      continue
    text = instruction(task, tokenizer.decode(passage[:keep].tolist()))
    ids = chat_prompt(tokenizer, text)
    if len(ids) == prompt_tokens:
      return np.asarray(ids, np.int32), text
  return None


def shingles(text: str, n: int = 13) -> set[tuple[str, ...]]:
  """The runs of n consecutive words of `text`, lower-cased, punctuation dropped."""
  words = re.findall(r"[a-z0-9']+", text.lower())
  return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def overlap(texts: Iterable[str], others: Iterable[str], n: int = 13) -> set[tuple[str, ...]]:
  """The n-word runs that some text of `texts` shares with some text of `others`: a test set's
  contamination check (13 words, as GPT-3's and Llama's)."""
  seen = set().union(*(shingles(text, n) for text in texts))
  return seen & set().union(*(shingles(text, n) for text in others))
