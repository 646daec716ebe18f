"""The benchmark record's markdown tables and the per-stack numbers its plots need. Free of
flags, so that tests and notebooks import it beside any launcher."""

from __future__ import annotations

import statistics


def stack_shape(stack) -> dict:
  """The numbers a plot by (gamma1, gamma2) needs: the bottom tree's depth, size and width (the
  root's children), and the gamma of each intermediate level, bottom-up (empty for ar)."""
  if stack is None or stack.tree is None:
    return {}
  tree = stack.tree
  width = tree.max_branching if hasattr(tree, "max_branching") else tree.width  # static; dynamic
  return {"tree_depth": tree.max_depth, "tree_size": tree.size, "tree_width": int(width),
          "gammas": [v.gamma for v in stack.verifiers]}


def differs_cell(partings: list[dict], unit: str) -> str:
  """A report's `greedy = ar` cell: yes, or how many runs (`unit`: turns, prompts) part and the
  widest margin they part at."""
  if not partings:
    return "yes"
  cell = f"no: {len(partings)} {unit}"
  if all("margin" in d for d in partings):
    cell += f", at top-2 logit margins of at most {max(d['margin'] for d in partings):.4f}"
  return cell


def name(row: dict) -> str:
  """A row's name in tables: its method, and its batch size past 1."""
  return row["method"] + (f" x{row['batch_size']}" if row.get("batch_size", 1) != 1 else "")


def markdown(rows) -> str:
  """The speed table, with a `greedy = ar` column where greedy methods were compared with ar, and
  a batch column where a batch of more than one was run (tok/s then counts every row's tokens,
  and the speedup is over `ar` at the same batch size)."""
  compared = any("differs_from_ar" in r for r in rows)
  batched = any(r.get("batch_size", 1) != 1 for r in rows)
  lines = ["| method | prompt tokens | " + ("batch | " if batched else "") + "decode tok/s (median) | "
           "speedup vs ar | mean accepted | prefill s | compile s |" + (" greedy = ar |" if compared else ""),
           "|---|---|---|---|---|---|---|" + ("---|" if batched else "") + ("---|" if compared else "")]
  at = lambda r: (r["prompt_tokens"], r.get("batch_size", 1))
  base = {at(r): r["median_decode_tokens_per_s"] for r in rows if r["method"] == "ar"}
  for r in rows:
    speedup = r["median_decode_tokens_per_s"] / base[at(r)] if at(r) in base else float("nan")
    accepted, compile_s = r["median_mean_accepted"], r["compile_s"]
    lines.append(f"| {r['method']} | {r['prompt_tokens']} | " + (f"{r.get('batch_size', 1)} | " if batched else "")
                 + f"{r['median_decode_tokens_per_s']:.2f} | "
                 f"{speedup:.2f}x | {'–' if accepted is None else f'{accepted:.2f}'} | "
                 f"{r['median_prefill_s']:.2f} | {'–' if compile_s is None else f'{compile_s:.1f}'} |"
                 + (f" {differs_cell(r['differs_from_ar'], 'prompts') if 'differs_from_ar' in r else '–'} |"
                    if compared else ""))
  return "\n".join(lines)


def level_markdown(rows) -> str:
  """Per verifying level of each speculative method: acceptance, forwards per run and, with
  --time_levels, one round's time and the share of the decode time (medians over runs)."""
  lines = ["| method | prompt tokens | level (proposer -> verifier) | accepted / proposed | alpha | "
           "forwards | round ms | share of decode time |", "|---|---|---|---|---|---|---|---|"]
  med = lambda values: statistics.median(values) if values else None
  fmt = lambda x, spec: "–" if x is None else format(x, spec)
  for r in rows:
    runs = [run["levels"] for run in r["runs"] if run.get("levels")]
    for j, level in enumerate(runs[0] if runs else []):
      at = [run[j] for run in runs]
      if j == 0 and "proposer_round_ms" in level:
        lines.append(f"| {name(r)} | {r['prompt_tokens']} | {level['proposer']} (drafting) | – | – | "
                     f"{fmt(med([x['forwards'] for x in at]), '.0f')} | "
                     f"{fmt(med([x['proposer_round_ms'] for x in at]), '.1f')} | "
                     f"{fmt(med([x['proposer_time_share'] for x in at]), '.0%')} |")
      acceptance = med([x["acceptance"] for x in at if x["acceptance"] is not None])
      alpha = med([x["alpha"] for x in at if x.get("alpha") is not None])
      lines.append(f"| {name(r)} | {r['prompt_tokens']} | {level['proposer']} -> {level['name']} | "
                   f"{fmt(acceptance, '.2f')} | {fmt(alpha, '.2f')} | "
                   f"{fmt(med([x['forwards'] for x in at]), '.0f')} | "
                   f"{fmt(med([x['round_ms'] for x in at if 'round_ms' in x]), '.1f')} | "
                   f"{fmt(med([x['time_share'] for x in at if 'time_share' in x]), '.0%')} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def prediction_markdown(rows) -> str:
  """--predict: the planner's prediction against measurement per stack, and the summary the
  planner is judged by (share within 15%, Spearman's rank correlation)."""
  from .plots import prediction_errors
  errors = prediction_errors(rows)
  if not errors:
    return ""
  lines = ["| method | prompt tokens | batch | measured tok/s | predicted tok/s | error | measured / predicted "
           "tokens per target forward |", "|---|---|---|---|---|---|---|"]
  for r, e in errors:
    lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r.get('batch_size', 1)} | "
                 f"{r['median_decode_tokens_per_s']:.1f} | "
                 f"{r['predicted_tokens_per_s']:.1f} | {e:+.0%} | {r['median_mean_accepted'] or 1:.2f} / "
                 f"{r['predicted_tokens_per_target_forward']:.2f} |")
  within = sum(abs(e) <= 0.15 for _, e in errors)
  lines.append(f"\n{within} of {len(errors)} within 15%; Spearman's rank correlation "
               f"{rank_correlation(errors):.2f}.")
  return "\n".join(lines)


def rank_correlation(errors) -> float:
  """Spearman's rho of predicted against measured tok/s (ties broken by order)."""
  import numpy as np
  if len(errors) < 2:
    return float("nan")
  measured = np.array([r["median_decode_tokens_per_s"] for r, _ in errors])
  predicted = np.array([r["predicted_tokens_per_s"] for r, _ in errors])
  ranks = lambda x: np.argsort(np.argsort(x))
  return float(np.corrcoef(ranks(measured), ranks(predicted))[0, 1])
