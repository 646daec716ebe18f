"""launch.benchmark --prompts=specbench: Spec-Bench's protocol, its report and its exactness check.

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

from hitree_jax import spec_bench

from .tables import differs_cell


def answer(model, tokenizer, method, question: spec_bench.Question, sampling, programs, mesh,
           max_new_tokens: int, seed: int) -> list[dict]:
  """One question, turn by turn: [{new_tokens, decode_s, prefill_s, target_forwards, compiles,
  tokens, prompt}] per turn (prompt: the turn's token ids, the conversation so far)."""
  from hitree_jax.tokenizer import conversation_prompt
  answers, turns = [], []
  for t in range(len(question.turns)):
    ids = conversation_prompt(tokenizer, question.turns[:t + 1], answers)
    r = method.generate(model.params, model.config, [ids], max_new_tokens=max_new_tokens, sampling=sampling,
                        seed=seed, stop_at_eos=True, programs=programs, mesh=mesh)
    tokens = r.tokens[0]
    answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
    turns.append({"prompt_tokens": len(ids), "new_tokens": len(tokens), "decode_s": r.decode_s,
                  "prefill_s": r.prefill_s, "target_forwards": r.target_forwards or len(tokens),
                  "compiles": r.compiles, "tokens": tokens, "prompt": ids})
  return turns


def mismatches(runs: list[dict], ar_runs: list[dict], margins_of=None, tie: float | None = None) -> list[dict]:
  """The turns whose tokens differ from `ar`'s: {question_id, turn, at} (near_ties.compare), with
  margins_of (near_ties.top2_margins over `ar`'s answer) also how close to a tie the target was
  there (margin, smaller_in_answer, median_margin; with `tie`, near_tie)."""
  from hitree_jax import near_ties
  out = []
  for run, ar in zip(runs, ar_runs):
    for t, (mine, theirs) in enumerate(zip(run["turns"], ar["turns"])):
      parted = near_ties.compare(theirs["prompt"], mine["tokens"], theirs["tokens"], margins_of, tie)
      if parted is not None:
        out.append({"question_id": run["question_id"], "turn": t + 1, **parted})
  return out


def parting_line(method: str, d: dict) -> str:
  """One mismatch as the run prints it."""
  from hitree_jax import near_ties
  return f"{method}: question {d['question_id']} turn {d['turn']} {near_ties.describe(d)}"


def summary(runs: list[dict]) -> dict:
  """Totals over some questions' turns: tokens/s (total over total, Spec-Bench's), τ."""
  turns = [t for r in runs for t in r["turns"]]
  new = sum(t["new_tokens"] for t in turns)
  seconds = sum(t["decode_s"] for t in turns)
  forwards = sum(t["target_forwards"] for t in turns)
  return {"questions": len(runs), "turns": len(turns), "new_tokens": new, "decode_s": seconds,
          "tokens_per_s": new / seconds if seconds else 0.0, "tau": new / forwards if forwards else None,
          "median_prefill_s": statistics.median(t["prefill_s"] for t in turns) if turns else None}


def rows(by_method: dict[str, list[dict]], greedy: bool, margins_of=None, tie: float | None = None) -> list[dict]:
  """Per method: per task and overall, tokens/s, τ and the speedup over `ar`; with greedy
  decoding, the turns that differ from `ar`'s (with margins_of: how near a tie, `mismatches`)."""
  tasks = list(dict.fromkeys(r["task"] for runs in by_method.values() for r in runs))
  per = {m: {task: summary([r for r in runs if r["task"] == task]) for task in tasks}
         for m, runs in by_method.items()}
  overall = {m: summary(runs) for m, runs in by_method.items()}
  base = per.get("ar"), overall.get("ar")
  out = []
  for m, runs in by_method.items():
    row = {"method": m, "tasks": per[m], "overall": overall[m]}
    for entry, ar in [*((per[m][t], base[0][t] if base[0] else None) for t in tasks), (overall[m], base[1])]:
      entry["speedup"] = entry["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] else None
    if greedy and "ar" in by_method and m != "ar":
      row["differs_from_ar"] = mismatches(runs, by_method["ar"], margins_of, tie)
    out.append(row)
  return out


def markdown(results: list[dict]) -> str:
  """Spec-Bench's leaderboard: speedup per task, then overall speedup, τ and tok/s."""
  tasks = list(results[0]["tasks"]) if results else []
  fmt = lambda x, f="{:.2f}x": "–" if x is None else f.format(x)
  lines = ["| method | " + " | ".join(tasks) + " | overall | τ (tokens per target forward) | tok/s | "
           "greedy = ar |", "|---|" + "---|" * (len(tasks) + 4)]
  for r in results:
    same = "–" if "differs_from_ar" not in r else differs_cell(r["differs_from_ar"], "turns")
    lines.append(f"| {r['method']} | " + " | ".join(fmt(r["tasks"][t]["speedup"]) for t in tasks) +
                 f" | {fmt(r['overall']['speedup'])} | {fmt(r['overall']['tau'], '{:.2f}')} | "
                 f"{r['overall']['tokens_per_s']:.2f} | {same} |")
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
    ax.bar(np.arange(len(tasks)) + (i - (len(shown) - 1) / 2) * width, values, width, label=r["method"])
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
