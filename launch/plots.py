"""PNG figures of a launch.benchmark record (its JSON as a dict), readable without the table.

  speed_figure(record, "results_speed.png")            decode tok/s and speedup vs ar
  acceptance_figure(record, "results_acceptance.png")  accepted draft tokens per round, by depth
  levels_figure(record, "results_levels.png")          acceptance and share of time per level
  gamma_figure(record, "results_gammas.png")           hierarchies: speedup by (gamma1, gamma2)
  predicted_figure(record, "results_predicted.png")    the planner's predictions against measurement

They take the record rather than the runs so that a saved results.json can be
plotted again, and later records (per-level acceptance) can add figures here.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def title(record: dict) -> str:
  sampling = ("greedy" if not record.get("temperature") else
              f"temperature {record['temperature']:g}, top_p {record.get('top_p', 1.0):g}")
  return (f"{record.get('model', '?')} ({record.get('dtype', '?')}, {record.get('backend', '?')}): "
          f"{sampling}, {record.get('max_new_tokens', '?')} new tokens")


def by_method(rows: list[dict]) -> dict[str, list[dict]]:
  """Rows grouped per method (first-seen order), each group sorted by prompt length."""
  groups: dict[str, list[dict]] = {}
  for row in rows:
    groups.setdefault(row["method"], []).append(row)
  return {m: sorted(g, key=lambda r: r["prompt_tokens"]) for m, g in groups.items()}


def colors(groups: dict) -> dict[str, str]:
  """One colour per method, the same in every figure (the acceptance figure leaves out ar)."""
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  if len(groups) > len(cycle):  # a sweep of a dozen stacks: no two methods share a colour
    cycle = [plt.cm.tab20(i % 20) for i in range(len(groups))]
  return {m: cycle[i % len(cycle)] for i, m in enumerate(groups)}


def _prompt_axis(ax, lengths):
  ax.set_xscale("log")
  ax.set_xticks(lengths, [str(n) for n in lengths])
  ax.minorticks_off()
  ax.set_xlabel("prompt tokens")
  ax.grid(True, alpha=0.3)


def speed_figure(record: dict, path: str | pathlib.Path) -> None:
  """Median decode tok/s per method against prompt length; beside it the speedup vs `ar`."""
  groups = by_method(record["results"])
  color = colors(groups)
  base = {r["prompt_tokens"]: r["median_decode_tokens_per_s"] for r in groups.get("ar", [])}
  lengths = sorted({r["prompt_tokens"] for r in record["results"]})
  panels = 2 if base and len(groups) > 1 else 1
  fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
  speed = axes[0][0]
  for method, rows in groups.items():
    speed.plot([r["prompt_tokens"] for r in rows], [r["median_decode_tokens_per_s"] for r in rows],
               marker="o", color=color[method], label=method)
  speed.set_ylabel("decode tokens/s (median over prompts)")
  speed.set_title("decode speed")
  speed.set_ylim(bottom=0)
  _prompt_axis(speed, lengths)
  if panels == 2:
    ratio = axes[0][1]
    for method, rows in groups.items():
      rows = [r for r in rows if r["prompt_tokens"] in base]
      ratio.plot([r["prompt_tokens"] for r in rows],
                 [r["median_decode_tokens_per_s"] / base[r["prompt_tokens"]] for r in rows],
                 marker="o", color=color[method], label=method)
    ratio.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ratio.set_ylabel("speedup vs ar (x)")
    ratio.set_title("speedup over autoregressive decoding")
    ratio.set_ylim(bottom=0)
    _prompt_axis(ratio, lengths)
  _legend_below(fig, speed)
  _save(fig, record, path)


def acceptance_per_depth(rows: list[dict]) -> list[float] | None:
  """Draft tokens accepted at each tree depth per round (target forward), pooled over the runs.

  At most one token per depth is accepted in a round, so this is the rate at which a round's
  accepted path reaches that depth. None for methods without it (ar)."""
  runs = [run for row in rows for run in row["runs"]
          if run.get("accepted_per_depth") and run.get("target_forwards")]
  if not runs:
    return None
  depth = max(len(run["accepted_per_depth"]) for run in runs)
  accepted = [sum(run["accepted_per_depth"][d] for run in runs if d < len(run["accepted_per_depth"]))
              for d in range(depth)]
  rounds = sum(run["target_forwards"] for run in runs)
  return [a / rounds for a in accepted]


def acceptance_figure(record: dict, path: str | pathlib.Path) -> bool:
  """Per speculative method, accepted draft tokens per round at each depth; False (no file) if
  the record has no speculative method."""
  groups = by_method(record["results"])
  color = colors(groups)
  curves = {m: acceptance_per_depth(rows) for m, rows in groups.items()}
  curves = {m: c for m, c in curves.items() if c}
  if not curves:
    return False
  fig, ax = plt.subplots(figsize=(7, 4.8))
  for method, rates in curves.items():
    ax.plot(range(1, len(rates) + 1), rates, marker="o", color=color[method],
            label=f"{method} ({sum(rates):.2f} draft tokens/round)")
  depth = max(len(c) for c in curves.values())
  ax.set_xticks(range(1, depth + 1))
  ax.set_xlabel("tree depth")
  ax.set_ylabel("draft tokens accepted per round")
  ax.set_ylim(0, 1.05)
  ax.grid(True, alpha=0.3)
  ax.set_title("acceptance by depth (all prompts)")
  _legend_below(fig, ax)
  _save(fig, record, path)
  return True


def level_acceptance(rows: list[dict]) -> list[float] | None:
  """Per verifying level (bottom-up), accepted / proposed pooled over the runs; None if the
  method has no level record."""
  runs = [run["levels"] for row in rows for run in row["runs"] if run.get("levels")]
  if not runs:
    return None
  return [sum(run[j]["accepted"] for run in runs) / max(1, sum(run[j]["proposed"] for run in runs))
          for j in range(len(runs[0]))]


def time_shares(rows: list[dict]) -> dict[str, float] | None:
  """Mean share of the decode time: the drafter's proposals, then each verifying level (None
  without --time_levels)."""
  runs = [run["levels"] for row in rows for run in row["runs"]
          if run.get("levels") and "time_share" in run["levels"][0]]
  if not runs:
    return None
  mean = lambda values: sum(values) / len(values)
  shares = {f"drafting ({runs[0][0]['proposer']})": mean([run[0]["proposer_time_share"] for run in runs])}
  for j, level in enumerate(runs[0]):
    shares[f"level {j + 1}: {level['name']}"] = mean([run[j]["time_share"] for run in runs])
  return shares


def levels_figure(record: dict, path: str | pathlib.Path) -> bool:
  """Acceptance at each level (bottom-up: level 1 verifies the drafter) per speculative method,
  e.g. a tree against a chain at the bottom; beside it, with level times, where the decode time
  went. False (no file) without a speculative method."""
  groups = by_method(record["results"])
  color = colors(groups)
  acceptance = {m: a for m, rows in groups.items() if (a := level_acceptance(rows))}
  if not acceptance:
    return False
  shares = {m: t for m, rows in groups.items() if m in acceptance and (t := time_shares(rows))}
  fig, axes = plt.subplots(1, 2 if shares else 1, figsize=(13 if shares else 7, 4.8), squeeze=False)
  ax = axes[0][0]
  levels = max(len(a) for a in acceptance.values())
  width = 0.8 / len(acceptance)
  for i, (method, rates) in enumerate(acceptance.items()):
    ax.bar([j + i * width for j in range(len(rates))], rates, width, color=color[method], label=method)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(levels)],
                [f"level {j + 1}" + (" (drafter's proposals)" if j == 0 else "") for j in range(levels)])
  ax.set_ylabel("accepted / proposed")
  ax.set_ylim(0, 1.05)
  ax.grid(True, axis="y", alpha=0.3)
  ax.set_title("acceptance per level (all prompts)")
  if shares:
    right = axes[0][1]
    for i, (method, parts) in enumerate(shares.items()):
      bottom = 0.0
      for k, (part, share) in enumerate(parts.items()):
        right.bar(i, share, 0.6, bottom=bottom, color=plt.cm.tab10(k), edgecolor="white")
        short = "draft" if k == 0 else f"L{k}"   # the legend of the left panel names them
        right.text(i, bottom + share / 2, short if share > 0.06 else "", ha="center", va="center",
                   fontsize="x-small")
        bottom += share
      right.bar(i, max(0.0, 1 - bottom), 0.6, bottom=bottom, color="lightgrey", edgecolor="white")
    right.set_xticks(range(len(shares)), [f"{i + 1}" for i in range(len(shares))])
    right.set_xlabel("method (numbered in the legend's order); draft: proposing, Lj: level j")
    right.set_ylabel("share of decode time (grey: the rest)")
    right.set_title("time per level: rounds x one round's time alone")
  _legend_below(fig, ax)
  _save(fig, record, path)
  return True


def gamma_figure(record: dict, path: str | pathlib.Path) -> bool:
  """Speedup vs ar of three-level stacks against gamma1 (the bottom tree's depth), a line per
  (gamma2, tree shape), at the longest prompt length; False (no file) with fewer than two."""
  rows = record["results"]
  base = {r["prompt_tokens"]: r["median_decode_tokens_per_s"] for r in rows if r["method"] == "ar"}
  three = [r for r in rows if len(r.get("gammas") or []) == 1 and r["prompt_tokens"] in base]
  if len(three) < 2:
    return False
  longest = max(r["prompt_tokens"] for r in three)
  lines: dict[str, list[tuple[int, float]]] = {}
  for r in three:
    if r["prompt_tokens"] == longest:
      width = r.get("tree_width", 1 if r["tree_size"] == r["tree_depth"] else 2)
      shape = {1: "chain", 2: "binary tree", 3: "ternary tree"}.get(width, f"{width}-ary tree")
      lines.setdefault(f"gamma2 = {r['gammas'][0]}, {shape}", []).append(
          (r["tree_depth"], r["median_decode_tokens_per_s"] / base[longest]))
  fig, ax = plt.subplots(figsize=(7, 4.8))
  for label, points in sorted(lines.items()):
    points.sort()
    ax.plot([g for g, _ in points], [x for _, x in points], marker="o", label=label)
  ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
  ax.set_xticks(sorted({r["tree_depth"] for r in three}))
  ax.set_xlabel("gamma1 (depth of the bottom chain or tree)")
  ax.set_ylabel("speedup vs ar (x)")
  ax.set_ylim(bottom=0)
  ax.grid(True, alpha=0.3)
  ax.set_title(f"hierarchies by (gamma1, gamma2), {longest}-token prompts")
  _legend_below(fig, ax)
  _save(fig, record, path)
  return True


def prediction_errors(rows: list[dict]) -> list[tuple[dict, float]]:
  """(row, relative error of the planner's prediction: predicted / measured - 1) for each row
  that carries one (launch.benchmark --predict)."""
  return [(r, r["predicted_tokens_per_s"] / r["median_decode_tokens_per_s"] - 1) for r in rows
          if r.get("predicted_tokens_per_s")]


def predicted_figure(record: dict, path: str | pathlib.Path) -> bool:
  """The planner's predicted tok/s against the measured, a point per (stack, prompt length),
  with the +-15% band; False (no file) when no row has a prediction."""
  errors = prediction_errors(record["results"])
  if not errors:
    return False
  groups = by_method([r for r, _ in errors])
  color = colors(groups)
  marker = {n: m for n, m in zip(sorted({r["prompt_tokens"] for r, _ in errors}), "os^Dv")}
  fig, ax = plt.subplots(figsize=(7, 6))
  top = 1.1 * max(max(r["predicted_tokens_per_s"], r["median_decode_tokens_per_s"]) for r, _ in errors)
  ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
  ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="grey", alpha=0.12, label="within 15%")
  for method, rows in groups.items():
    for r in rows:
      ax.scatter(r["median_decode_tokens_per_s"], r["predicted_tokens_per_s"], color=color[method],
                 marker=marker.get(r["prompt_tokens"], "o"),
                 label=f"{method} ({r['prompt_tokens']})")
  within = sum(abs(e) <= 0.15 for _, e in errors)
  ax.set_xlim(0, top)
  ax.set_ylim(0, top)
  ax.set_xlabel("measured decode tok/s (median)")
  ax.set_ylabel("predicted tok/s (planner/latency.py)")
  ax.set_title(f"planner: {within} of {len(errors)} stacks predicted within 15%")
  ax.grid(True, alpha=0.3)
  _legend_below(fig, ax)
  _save(fig, record, path)
  return True


def _legend_below(fig, ax):
  """Method labels (with draft paths) can be long: a legend under the axes hides no data."""
  handles, labels = ax.get_legend_handles_labels()
  fig.tight_layout()
  fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False,
             ncol=1 if max(map(len, labels)) > 40 else 2, fontsize="small")


def _save(fig, record, path):
  fig.suptitle(title(record), fontsize="medium", y=1.02)
  fig.savefig(path, dpi=120, bbox_inches="tight")  # grows the canvas to the legend and title
  plt.close(fig)
