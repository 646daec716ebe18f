"""Choose the fastest speculation stack for a model, its draft, a context length and a sampling
setting, from measured profiles (hitree_jax/planner), and write it as a config.

  python -m launch.plan --draft=drafts/smollm2-draft.gguf --prompt_tokens=2048 --out=plan.py
  python -m launch.generate --config=plan.py --text=austen --prompt_tokens=2048
  python -m launch.benchmark --config=plan.py --prompt_tokens=2048

It chooses plain decoding (`ar`) when no stack is predicted to beat it.

A grid of contexts and batch sizes prints one plan per cell (a profile each, measured at that
batch size: a round's cost at batch B is not B times one row's):

  python -m launch.plan --draft=drafts/smollm2-draft.gguf --prompt_tokens=512,2048 --batch_sizes=1,4,16

The first run at a (models, context, sampling) measures a profile: each candidate level's forward
cost, the acceptance between every pair of levels over the target's own continuation of a book
passage, and the engine's per-round overheads (a few minutes on a CPU). It is kept under
--profile_dir and reused while the models, the machine and jax are the same.
`launch.generate --method=auto` plans the same way, on first use.

--feature_draft=eagle:PATH adds an EAGLE draft to the candidate drafters (under the target or a
retrieval level, whose features it reads).

--predict=LEVELS,... also prints the model's prediction for stacks given in the --levels
grammar (e.g. draft/chain:2 or draft@streaming:16x234/chain:1+retrieval:512/6).

On paper, for a TPU slice you do not have (libtpu installed; no weights, no TPU):

  python -m launch.plan --topology=v5e:2x4 --shapes=configs/llama2_7b_128k.py \
      --acceptance=configs/acceptance/triforce_llama2_7b_128k.json

costs each level the acceptance file names by the TPU compiler's roofline of its forward
(hitree_jax/roofline.py), takes acceptance from the file (a paper's figures, or a profile measured
here: hitree_jax/planner/on_paper.py), and predicts every stack with the same model and search.
It prints `ar`, the stacks named by --predict and the fastest one: a prediction, not a measurement.
"""

from __future__ import annotations

import itertools
import json
import pathlib

from absl import flags, logging
from ml_collections import config_flags

from hitree_jax import methods
from hitree_jax.data import CHAT
from hitree_jax.errors import UsageError
from . import common

common.define_model_flags()
common.define_sampling_flags()
flags.DEFINE_string("draft", None, "The draft model (a path), e.g. drafts/smollm2-draft.gguf.")
common.define_feature_draft_flag()
common.define_text_flag("austen", "Text the profile is measured on: a book corpus's passages, or chat "
                        "(instructions over held-out book passages in the chat template, for a chat "
                        "model's prompts).")
flags.DEFINE_list("prompt_tokens", ["2048"], "Context lengths to plan for, in tokens (a grid with "
                  "--batch_sizes).")
flags.DEFINE_list("batch_sizes", ["1"], "Batch sizes to plan for: prompts decoded together, a row each.")
flags.DEFINE_string("profile_dir", None, "Where profiles are kept (default: $HITREE_PROFILES, else "
                    "assets/profiles).")
flags.DEFINE_multi_string("predict", [], "Also print the prediction for this stack (--levels "
                          "grammar); repeatable.")
flags.DEFINE_float("min_gain", 0.10, "Choose a stack only if it is predicted this much faster than ar "
                   "(the model's error here is about 10%; 0: the fastest prediction wins).")
flags.DEFINE_bool("full_profile", False, "Measure a profile in full: every level's forward at five "
                  "widths, and a round's overheads fitted at this context, not taken from a kept "
                  "profile of these models or from the fits shipped with the shipped drafts.")
flags.DEFINE_string("out", None, "Write the chosen stack here as a config (.py) for launch.generate "
                    "and launch.benchmark, with the plan and its prediction in a .json beside it. "
                    "On paper (--topology): the predictions as FILE.json and a table as FILE.md.")
flags.DEFINE_string("topology", None, "Plan on paper for a TPU slice (v5e:2x4, v6e:2x4, ...): levels "
                    "costed by the TPU compiler's roofline, acceptance from --acceptance; needs "
                    "--shapes and libtpu (./setup.sh --tpu).")
config_flags.DEFINE_config_file("shapes", None, "On paper: the model shapes and stack sizes, e.g. "
                                "configs/llama2_7b_128k.py.")
flags.DEFINE_string("acceptance", None, "On paper: a JSON file of per-pair acceptance with its source, "
                    "e.g. configs/acceptance/triforce_llama2_7b_128k.json, or a profile measured here.")
flags.DEFINE_string("mesh", None, "On paper: the mesh over the slice's devices (default model:N).")
FLAGS = flags.FLAGS

CONFIG = '''"""{title}

  python -m launch.generate --config={path} {prompt}
  python -m launch.benchmark --config={path} --prompt_tokens={context}
"""

from ml_collections import config_dict


def get_config():
  return config_dict.ConfigDict({flags!r})
'''


def write_config(out: str, choice, draft: str, title: str, context: int,
                 eagle: str | None = None, precision: dict | None = None) -> list[pathlib.Path]:
  """The plan as a config, with the target's precision (auto.precision) it was planned for."""
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  flags = {**choice.flags(draft, eagle), **{k: v for k, v in (precision or {}).items() if v is not None}}
  prompt = (f"--text={FLAGS.text} --prompt_tokens={context}" if FLAGS.text != CHAT else
            '--text=chat --prompt="..."')
  path.write_text(CONFIG.format(title=title, path=path, context=context, flags=flags, prompt=prompt))
  record = path.with_suffix(".json")
  from hitree_jax.planner import auto
  best = choice.best_stack
  record.write_text(json.dumps({"title": title, "flags": flags,
                                "predicted_tokens_per_s": choice.predicted_tokens_per_s,
                                "ar_tokens_per_s": choice.ar_tokens_per_s,
                                "fastest_stack": {"levels": str(auto.levels_of(best)),
                                                  "predicted_tokens_per_s": 1 / best.exact.seconds_per_token,
                                                  "tokens_per_target_forward": best.exact.tokens_per_target_forward}},
                               indent=1))
  return [path, record]


PAPER_WIDTHS = (1, 8, 16)   # a level's roofline is affine in its width (planner.latency.affine)


def cost_of(levels, name: str, context: int, tail: int) -> dict[int, float]:
  """{width: roofline seconds} of a level, by its profile name."""
  from hitree_jax.cache.kinds import Streaming
  from hitree_jax.decode import spec
  from hitree_jax.planner import auto
  level = auto.level_named(name)
  if level == auto.TARGET:
    costs = levels.target_full(context, PAPER_WIDTHS)
  elif level == auto.EAGLE:
    costs = levels.eagle(context, PAPER_WIDTHS)
  elif level.kind == "retrieval":
    costs = levels.retrieval(context, level.budget, 8, tail, PAPER_WIDTHS)
  elif level.source == spec.DraftModel() and isinstance(level.cache, Streaming):
    costs = levels.draft_streaming(context, level.cache.sinks, level.cache.window, PAPER_WIDTHS)
  else:
    raise UsageError(f"--acceptance: level {name!r} cannot be costed on paper (target, retrieval:B, "
                     "draft@streaming:SxW and eagle can)")
  return {c.width: c.seconds for c in costs}


def plan_on_paper() -> None:
  cfg = FLAGS.shapes
  if cfg is None or FLAGS.acceptance is None:
    raise UsageError(f"--topology={FLAGS.topology} plans on paper: give --shapes (e.g. "
                     "configs/llama2_7b_128k.py) and --acceptance (e.g. "
                     "configs/acceptance/triforce_llama2_7b_128k.json)")
  if FLAGS.out is not None and not FLAGS.out.endswith(".json"):
    raise UsageError(f"--out={FLAGS.out}: on paper the plan is written as a .json record")
  from hitree_jax import memory_plan, roofline, sharding, topology
  from hitree_jax.decode.prefill import cache_slots, round_up
  from hitree_jax.planner import auto, on_paper
  acceptance = on_paper.load_acceptance(FLAGS.acceptance)
  given = common.positive_ints("prompt_tokens")
  if FLAGS["prompt_tokens"].present and len(given) > 1:
    raise UsageError(f"--prompt_tokens={','.join(FLAGS.prompt_tokens)}: on paper, plan one context at a time")
  context = given[0] if FLAGS["prompt_tokens"].present else cfg.prompt_tokens
  mesh = topology.mesh(FLAGS.topology, FLAGS.mesh)
  target, draft = memory_plan.shapes_models(cfg)
  slots = cache_slots(context, cfg.max_new_tokens, extra=max(PAPER_WIDTHS))   # the engine's full cache
  sharding.check(target, mesh, 1, slots)
  chip = roofline.Chip.of(mesh.devices.flat[0])
  levels = roofline.Levels(target, draft, mesh, chip)
  tail = round_up(cfg.max_new_tokens + max(PAPER_WIDTHS), 8)
  names = on_paper.levels_of(acceptance["acceptance"])
  costs = {name: cost_of(levels, name, slots, tail) for name in names}
  profile = on_paper.profile(costs, acceptance["acceptance"], context)
  greedy = float(common.sampling_from_flags(FLAGS).temperature) == 0
  space = on_paper.space_for(acceptance["acceptance"])
  choice = auto.choose(profile, greedy, space, min_gain=FLAGS.min_gain)
  rows = [("ar", 1 / profile["ar_seconds"], 1.0)]
  for levels in [*FLAGS.predict, str(auto.levels_of(choice.best_stack))]:
    got = auto.predict(profile, greedy, levels, space=space)
    rows.append((levels, 1 / got.seconds_per_token, got.tokens_per_target_forward))
  record = {"source": "prediction: levels by the roofline of the TPU compiler's programs, not measured; "
                      "no per-round overheads", "acceptance_source": acceptance["source"],
            "topology": FLAGS.topology, "device_kind": chip.kind, "mesh": sharding.describe(mesh),
            "shapes": config_flags.get_config_filename(FLAGS["shapes"]), "context": context,
            "greedy": greedy, "costs_ms": {n: {w: 1e3 * s for w, s in c.items()} for n, c in costs.items()},
            "stacks": [{"levels": n, "tokens_per_s": t, "speedup": t * profile["ar_seconds"],
                        "tokens_per_target_forward": f} for n, t, f in rows],
            "chosen": str(choice.levels) if choice.levels else "ar"}
  table = paper_table(record)
  print(table)
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(record, indent=1))
    pathlib.Path(FLAGS.out).with_suffix(".md").write_text(table + "\n")
  print(json.dumps(record))


def paper_table(record: dict) -> str:
  lines = [f"Predicted for {record['shapes']} at {record['context']} tokens on {record['device_kind']} "
           f"({record['topology']}, {record['mesh']}), {'greedy' if record['greedy'] else 'sampled'}: "
           f"{record['source']}.", f"Acceptance: {record['acceptance_source']}", "",
           "| stack | tok/s | x `ar` | tokens per target forward |", "|---|---|---|---|"]
  for s in record["stacks"]:
    lines.append(f"| `{s['levels']}` | {s['tokens_per_s']:.1f} | {s['speedup']:.2f}x | "
                 f"{s['tokens_per_target_forward']:.2f} |")
  lines.append(f"\nchosen: `{record['chosen']}`")
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.topology is not None:
    return plan_on_paper()
  if FLAGS.draft is None:
    raise UsageError("--draft: give the draft model's path (e.g. drafts/smollm2-draft.gguf)")
  contexts, batches = common.positive_ints("prompt_tokens"), common.positive_ints("batch_sizes")
  if FLAGS.out is not None and not FLAGS.out.endswith(".py"):
    raise UsageError(f"--out={FLAGS.out}: a config is a .py file")
  if FLAGS.out is not None and len(contexts) * len(batches) > 1:
    raise UsageError(f"--out={FLAGS.out} writes one plan: give one --prompt_tokens and one --batch_sizes")
  if FLAGS.min_gain < 0:
    raise UsageError(f"--min_gain={FLAGS.min_gain} must be >= 0")
  eagle = methods.check_auto_draft(FLAGS.draft, FLAGS.feature_draft)
  if len(contexts) * len(batches) > 1:
    if FLAGS.predict:
      raise UsageError("--predict applies to one plan: give one --prompt_tokens and one --batch_sizes")
    return plan_grid(contexts, batches, eagle)
  plan_one(contexts[0], batches[0], eagle)


def plan_for(context: int, batch: int, eagle):
  from hitree_jax.planner import auto
  return auto.plan_for(FLAGS.model, FLAGS.draft, context, common.sampling_from_flags(FLAGS), FLAGS.profile_dir,
                       FLAGS.text, log=logging.info, min_gain=FLAGS.min_gain, eagle=eagle,
                       dtype=common.model_dtype(), key_dtype=FLAGS.key_dtype, batch=batch,
                       full=FLAGS.full_profile)


def plan_grid(contexts: list[int], batches: list[int], eagle) -> None:
  """One plan per (context, batch) cell, as a table (speeds per row; a batch's throughput is
  the batch times them)."""
  from hitree_jax.planner import auto
  print("| prompt tokens | batch | chosen | predicted tok/s per row | ar tok/s per row | x ar | fastest stack | "
        "its x ar | profile |")
  print("|---|---|---|---|---|---|---|---|---|")
  for context, batch in itertools.product(contexts, batches):
    choice, profile, path = plan_for(context, batch, eagle)
    chosen = f"hsd/{choice.levels}" if choice.levels else "ar"
    fastest = 1 / choice.best_stack.exact.seconds_per_token
    print(f"| {profile['context']} | {profile.get('batch', 1)} | `{chosen}` | {choice.predicted_tokens_per_s:.1f} | "
          f"{choice.ar_tokens_per_s:.1f} | {choice.predicted_tokens_per_s / choice.ar_tokens_per_s:.2f}x | "
          f"`hsd/{auto.levels_of(choice.best_stack)}` | {fastest / choice.ar_tokens_per_s:.2f}x | {path} |")


def plan_one(context: int, batch: int, eagle) -> None:
  from hitree_jax.planner import auto
  sampling = common.sampling_from_flags(FLAGS)
  choice, profile, path = plan_for(context, batch, eagle)
  greedy = float(sampling.temperature) == 0
  setting = "greedy" if greedy else f"T {FLAGS.temperature:g}, top-p {FLAGS.top_p:g}"
  if profile.get("batch", 1) > 1:
    setting += f", batches of {profile['batch']}"
  models = " + ".join([FLAGS.model, FLAGS.draft, *([FLAGS.feature_draft] if eagle else [])])
  target_precision = auto.precision(common.model_dtype(), FLAGS.key_dtype)
  if target_precision:
    setting += f", the target in {common.model_dtype()}" + (f" with keys in {target_precision['key_dtype']}"
                                                   if target_precision["key_dtype"] else "")
  title = (f"The stack launch.plan chose for {models} at {profile['context']} "
           f"tokens, {setting}: {choice.predicted_tokens_per_s:.1f} tok/s predicted.")
  best = choice.best_stack
  print(f"profile: {path}")
  print(f"chosen: {f'hsd/{choice.levels}' if choice.levels else 'ar'}: "
        f"{choice.predicted_tokens_per_s:.1f} tok/s predicted")
  print(f"  ar: {choice.ar_tokens_per_s:.1f} tok/s (measured)")
  print(f"  fastest stack: hsd/{auto.levels_of(best)}: {1 / best.exact.seconds_per_token:.1f} tok/s "
        f"predicted, {best.exact.tokens_per_target_forward:.2f} tokens per target forward")
  for levels in FLAGS.predict:
    got = auto.predict(profile, greedy, levels)
    print(f"  hsd/{levels}: {1 / got.seconds_per_token:.1f} tok/s predicted, "
          f"{got.tokens_per_target_forward:.2f} tokens per target forward")
  print("a middle level under the target pays from this acceptance of its tokens by the target "
        "(measured in brackets):")
  rate = "greedy" if greedy else "alpha"
  for middle, _ in auto.candidates(profile, greedy).middles:
    needed = auto.break_even(profile, greedy, middle)
    measured = profile["acceptance"].get(f"target<-{middle}", {}).get(rate)
    print(f"  {middle}: {'never' if needed is None else f'{needed:.2f}'} ({measured:.2f})")
  if FLAGS.out:
    written = write_config(FLAGS.out, choice, FLAGS.draft, title, profile["context"], eagle, target_precision)
    print("wrote " + ", ".join(map(str, written)))


def run():
  common.run(main)


if __name__ == "__main__":
  run()
