"""How far a profile's predictions move when its round overheads are borrowed from another context.

  python docs/results/planner/borrowed_overheads.py > docs/results/planner/borrowed_overheads_2048.md

Reads the 2,048-token profile in borrowed_overheads/ (SmolLM2-135M + smollm2-draft, greedy, fitted
at 2,048) and three fits at 512 tokens of the same models on the same machine, and prints the
chosen stack and the predicted seconds per token of five stacks with the profile's own overheads
and with each 512 fit's (auto.stored_overheads' choice, planner/auto.py).
"""

import json
import pathlib

from hitree_jax.planner import auto

HERE = pathlib.Path(__file__).parent / "borrowed_overheads"
STACKS = ("ngram:3/chain:3", "draft/chain:3", "draft/kary:2x2", "self:8/chain:2",
          "draft@streaming:16x234/chain:1+retrieval:512/6")


def main():
  record = json.loads((HERE / "ctx2048.json").read_text())
  own = record["profile"]
  rows = [("own (fitted at 2,048)", own)]
  for fit in sorted(HERE.glob("ctx512_fit*.json")):
    rows.append((f"borrowed from {fit.name}", dict(own, overheads=json.loads(fit.read_text())["profile"]["overheads"])))
  base = {s: auto.predict(own, True, s).seconds_per_token for s in STACKS}
  print("# Round overheads borrowed from 512 tokens, on the 2,048-token profile\n")
  print(f"Measured 2026-11-28 on a 2-core AMD EPYC ({record['key']['machine']}), jax {record['key']['jax']}, at "
        "commit 8d45ec9 and its parent; greedy, SmolLM2-135M + drafts/smollm2-draft.gguf, 3 Austen passages. Command: "
        "`python docs/results/planner/borrowed_overheads.py`.\n")
  print("| overheads | draft_forward ms | verify ms | tree ms | chosen | predicted tok/s | "
        + " | ".join(f"`{s}` ms/token" for s in STACKS) + " |")
  print("|---" * (6 + len(STACKS)) + "|")
  for name, profile in rows:
    choice = auto.choose(profile, True)
    o = profile["overheads"]
    cells = []
    for s in STACKS:
      t = auto.predict(profile, True, s).seconds_per_token
      cells.append(f"{t * 1e3:.1f}" + ("" if profile is own else f" ({(t / base[s] - 1) * 100:+.0f}%)"))
    print(f"| {name} | {o['draft_forward'] * 1e3:.2f} | {o['verify'] * 1e3:.2f} | {o['tree'] * 1e3:.2f} | "
          f"`{choice.levels}` | {choice.predicted_tokens_per_s:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
