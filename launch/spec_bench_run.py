"""launch.benchmark --text=chat: Spec-Bench's protocol, its report and its exactness check.

Each question is asked in the model's chat template. Turns are answered in order, each after
the model's own earlier answers (MT-bench's second turn). Generation stops at EOS or after
--max_new_tokens. A method's speed on a task is its new tokens over its decode seconds summed
over the task's turns, as Spec-Bench computes it. τ is the new tokens per target forward, and
the speedup is over `ar`'s speed on the same task in the same run. Under greedy decoding every
turn of every method must equal `ar`'s tokens; a turn that differs is reported with its
question id and the token where it parts, and with the target's top-2 logit margin there
(hitree_jax/near_ties.py): a near-tie, where rounding may pick either token, or a fault.
"""

from __future__ import annotations

import collections
import statistics
from typing import Sequence

from hitree_jax import spec_bench

from .tables import differs_cell, name


def answer(model, tokenizer, method, questions: Sequence[spec_bench.Question], sampling, programs,
           mesh, max_new_tokens: int, seed: int, size_caches_for: int = 0) -> list[list[dict]]:
  """Questions asked together, one batch per turn: turn t of every question that has one, each
  after the model's own earlier answers. Per question, per turn: {prompt_tokens, new_tokens,
  decode_s, rows, prefill_s, target_forwards, compiles, tokens, prompt}, where decode_s is the
  batch's, shared by its `rows` rows, and target_forwards the forwards while this row generated."""
  from hitree_jax.tokenizer import conversation_prompt
  answers = [[] for _ in questions]
  turns = [[] for _ in questions]
  for t in range(max(len(q.turns) for q in questions)):
    asked = [i for i, q in enumerate(questions) if t < len(q.turns)]
    prompts = [conversation_prompt(tokenizer, questions[i].turns[:t + 1], answers[i]) for i in asked]
    r = method.generate(model.params, model.config, prompts, max_new_tokens=max_new_tokens,
                        sampling=sampling, seed=seed, stop_at_eos=True, programs=programs, mesh=mesh,
                        size_caches_for=size_caches_for)
    for row, (i, ids) in enumerate(zip(asked, prompts)):
      tokens = r.tokens[row]
      answers[i].append(tokenizer.decode(tokens, skip_special_tokens=True))
      turns[i].append({"prompt_tokens": len(ids), "new_tokens": len(tokens), "decode_s": r.decode_s,
                       "rows": len(asked), "prefill_s": r.prefill_s,
                       "target_forwards": r.rounds_per_row[row] if r.rounds_per_row else len(tokens),
                       "compiles": r.compiles, "tokens": tokens, "prompt": ids})
  return turns


def batches(questions: Sequence[spec_bench.Question], batch_size: int) -> list[list[spec_bench.Question]]:
  """The questions in order, batch_size at a time (the last batch may be smaller)."""
  return [list(questions[i:i + batch_size]) for i in range(0, len(questions), batch_size)]


def mismatches(runs: list[dict], ar_runs: list[dict], margins_of=None, tie: float | None = None) -> list[dict]:
  """The turns whose tokens differ from `ar`'s: {question_id, turn, at} (near_ties.compare), with
  margins_of (near_ties.top2_margins over `ar`'s answer) also how close to a tie the target was
  there (margin, smaller_in_answer, median_margin; with `tie`, near_tie). A question's turns after
  its first parting are not compared: their prompts hold the run's own earlier answer, not `ar`'s."""
  from hitree_jax import near_ties
  out = []
  for run, ar in zip(runs, ar_runs):
    for t, (mine, theirs) in enumerate(zip(run["turns"], ar["turns"])):
      if mine["prompt"] != theirs["prompt"]:
        break
      parted = near_ties.compare(theirs["prompt"], mine["tokens"], theirs["tokens"], margins_of, tie)
      if parted is not None:
        out.append({"question_id": run["question_id"], "turn": t + 1, **parted})
  return out


def parting_line(method: str, d: dict) -> str:
  """One mismatch as the run prints it."""
  from hitree_jax import near_ties
  return f"{method}: question {d['question_id']} turn {d['turn']} {near_ties.describe(d)}"


def summary(runs: list[dict]) -> dict:
  """Totals over some questions' turns: tokens/s over all rows (Spec-Bench's total over total,
  each batch's decode seconds counted once), τ, and a row's latency (its batch's decode seconds)."""
  turns = [t for r in runs for t in r["turns"]]
  new = sum(t["new_tokens"] for t in turns)
  seconds = sum(t["decode_s"] / t["rows"] for t in turns)
  forwards = sum(t["target_forwards"] for t in turns)
  median = lambda key: statistics.median(t[key] for t in turns) if turns else None
  return {"questions": len(runs), "turns": len(turns), "new_tokens": new, "decode_s": seconds,
          "tokens_per_s": new / seconds if seconds else 0.0, "tau": new / forwards if forwards else None,
          "median_row_latency_s": median("decode_s"), "median_prefill_s": median("prefill_s")}


def rows(by_run: dict[tuple[str, int], list[dict]], greedy: bool, margins_of=None,
         tie: float | None = None) -> list[dict]:
  """Per (method, batch size): per task and overall, tokens/s, τ and the speedup over `ar` at the
  same batch size; with greedy decoding, the turns that differ from what `ar` gives each prompt
  alone (batch 1; `ar` at the run's batch size when batch 1 was not run), with margins_of how
  near a tie (`mismatches`)."""
  tasks = list(dict.fromkeys(r["task"] for runs in by_run.values() for r in runs))
  out = []
  for (m, size), runs in by_run.items():
    ar = by_run.get(("ar", size))
    row = {"method": m, "batch_size": size, "overall": summary(runs),
           "tasks": {task: summary([r for r in runs if r["task"] == task]) for task in tasks}}
    for task in [*tasks, None]:
      entry = row["tasks"][task] if task else row["overall"]
      base = summary([r for r in ar if task in (None, r["task"])]) if ar else None
      entry["speedup"] = entry["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
    alone = by_run.get(("ar", 1)) or ar
    if greedy and alone is not None and alone is not runs:
      row["differs_from_ar"] = mismatches(runs, alone, margins_of, tie)
    out.append(row)
  return out


def markdown(results: list[dict]) -> str:
  """Spec-Bench's leaderboard: speedup per task, then overall speedup, τ, tok/s over all rows and
  a row's median latency, per method and batch size."""
  tasks = list(results[0]["tasks"]) if results else []
  fmt = lambda x, f="{:.2f}x": "–" if x is None else f.format(x)
  lines = ["| method | batch | " + " | ".join(tasks) + " | overall | τ (tokens per target forward) | "
           "tok/s | row latency s | greedy = ar |", "|---|---|" + "---|" * (len(tasks) + 5)]
  for r in results:
    same = "–" if "differs_from_ar" not in r else differs_cell(r["differs_from_ar"], "turns")
    lines.append(f"| {r['method']} | {r['batch_size']} | " + " | ".join(fmt(r["tasks"][t]["speedup"]) for t in tasks) +
                 f" | {fmt(r['overall']['speedup'])} | {fmt(r['overall']['tau'], '{:.2f}')} | "
                 f"{r['overall']['tokens_per_s']:.2f} | {fmt(r['overall']['median_row_latency_s'], '{:.2f}')} | {same} |")
  return "\n".join(lines)


def figure(results: list[dict], path) -> bool:
  """Speedup over `ar` by task, one bar per method (without `ar`, nothing to draw: False)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  shown = [r for r in results if r["method"] != "ar" and r["overall"]["speedup"] is not None]
  if not shown:
    return False
  tasks = [*results[0]["tasks"], "overall"]
  width = 0.8 / len(shown)
  fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(tasks)), 4.2))
  for i, r in enumerate(shown):
    values = [r["tasks"][t]["speedup"] if t != "overall" else r["overall"]["speedup"] for t in tasks]
    ax.bar(np.arange(len(tasks)) + (i - (len(shown) - 1) / 2) * width, values, width, label=name(r))
  ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
  ax.set_xticks(range(len(tasks)), tasks)
  ax.set_ylabel("speedup over ar (x)")
  ax.set_title("Spec-Bench: speedup by task")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def tasks_count(questions) -> dict[str, int]:
  return dict(collections.Counter(q.task for q in questions))
