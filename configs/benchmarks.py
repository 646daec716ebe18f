"""Benchmark suites for launch.benchmark.

  python -m launch.benchmark --config=configs/benchmarks.py:readme --out=results.json

`readme` is the table in the README (more in docs/performance.md); `long`, `gammas`
and `long_greedy` the long-context prompts the hierarchy is for (SmolLM2 has 8192
positions: 4K and 6K tokens, then 7.5K with every method and a sweep of (gamma1,
gamma2), then 7.5K greedy); `heads` / `heads_greedy` EAGLE and Medusa against the distilled
draft; `peers` our `ar` beside HF transformers and llama.cpp (after
`python -m launch.convert --out=smollm2_f32.gguf`); `planner` / `planner_sampled`
the planner's predictions against measurement (docs/planner.md), and
`planner_eagle` / `planner_eagle_sampled` with the EAGLE draft among its drafters; `quick` a
smoke test.
"""

from ml_collections import config_dict

DRAFT = "drafts/smollm2-draft.gguf"
EAGLE, MEDUSA = "eagle:drafts/smollm2-eagle", "medusa:drafts/smollm2-medusa"  # drafts on the target's features
HEADS = (f"ar,sd/{DRAFT}/2,sd/{EAGLE}/2,sd/{EAGLE}/3,tree/{EAGLE}/kary:2x2,tree/{EAGLE}/dynamic:8,4,"
         f"sd/{MEDUSA}/2,tree/{MEDUSA}/kary:2x2")
SAMPLED = dict(temperature=0.6, top_p=0.9)  # TriForce's and HiTree's setting

STREAMING = f"{DRAFT}@streaming:16x234"  # TriForce's draft cache: 16 sinks + 234 recent tokens
FOUR_LEVEL = f"hsd/ngram:3/chain:2+{DRAFT}/3+retrieval:1024/6"  # n-gram -> draft -> retrieval -> target


# The planner's validation (launch.benchmark --predict): stacks of 2, 3 and 4 levels, chains and
# trees, full and StreamingLLM draft caches, retrieval budgets of 256, 512 and 1024, the target over
# its retrieval cache drafting for itself (TriForce's two levels), and `auto`.
PLANNER = ",".join([
    "ar", "auto", f"sd/{DRAFT}/2", f"tree/{DRAFT}/kary:2x2", f"hsd/{STREAMING}/chain:3",
    f"hsd/{STREAMING}/chain:1+retrieval:512/6", f"hsd/{STREAMING}/chain:2+retrieval:1024/8",
    f"hsd/{STREAMING}/kary:2x2+retrieval:512/6", f"hsd/{DRAFT}/chain:2+retrieval:256/4",
    f"hsd/ngram:3/chain:2+{DRAFT}/3+retrieval:1024/6", f"hsd/{STREAMING}/chain:1+{DRAFT}/3+retrieval:512/6",
    "hsd/retrieval:1024/chain:6"])


# The planner with the EAGLE draft among its drafters (--feature_draft): EAGLE's stacks beside the
# distilled draft's, under the target and under a retrieval level.
PLANNER_EAGLE = ",".join([
    "ar", "auto", f"sd/{DRAFT}/2", f"sd/{EAGLE}/2", f"sd/{EAGLE}/3", f"tree/{EAGLE}/kary:2x2",
    f"hsd/{EAGLE}/chain:2+retrieval:256/4"])


def three_level(tree: str, gamma2: int) -> str:
  """The streaming draft's tree (or chain) under the target's retrieval level (1024 slots)."""
  return f"hsd/{STREAMING}/{tree}+retrieval:1024/{gamma2}"


SUITES = {
    "readme": dict(methods=f"ar,sd/{DRAFT}/2,sd/{DRAFT}/3,tree/{DRAFT}/sequoia:8,4,"
                           f"tree/{DRAFT}/dynamic:4,3,sd/ngram/4",
                   prompt_tokens="512,2048", max_new_tokens=128, n_prompts=2, **SAMPLED),
    # The hierarchy's lengths (SmolLM2 has 8192 positions); 7680 is `gammas`.
    "long": dict(methods=f"ar,tree/{DRAFT}/dynamic:4,3,retrieval/6,triforce/{DRAFT},"
                         f"hitree/{DRAFT}/kary:2x2,{FOUR_LEVEL}",
                 budget=1024, gamma2=6, prompt_tokens="4096,6144", max_new_tokens=256, n_prompts=2,
                 **SAMPLED),
    # 7.5K tokens: every method, and three-level stacks by (gamma1, gamma2): TriForce's chain of
    # 1, HiTree's binary trees of depth 2 and 4 and a ternary tree of depth 2, gamma2 6 and 12.
    "gammas": dict(methods=",".join([f"ar,tree/{DRAFT}/dynamic:4,3,retrieval/6,{FOUR_LEVEL}"] + [
                       three_level(tree, gamma2) for gamma2 in (6, 12)
                       for tree in ("chain:1", "kary:2x2", "kary:2x4", "kary:3x2")]),
                   budget=1024, prompt_tokens="7680", max_new_tokens=256, n_prompts=2, **SAMPLED),
    "long_greedy": dict(methods=f"ar,retrieval/6,triforce/{DRAFT},hitree/{DRAFT}/kary:2x2,{FOUR_LEVEL}",
                        budget=1024, gamma2=6, prompt_tokens="7680", max_new_tokens=256, n_prompts=2,
                        temperature=0.0),
    # EAGLE's feature draft and Medusa's heads against the distilled draft (issue: heads).
    "heads": dict(methods=HEADS, prompt_tokens="512,2048", max_new_tokens=128, n_prompts=2, **SAMPLED),
    "heads_greedy": dict(methods=HEADS, prompt_tokens="512,2048", max_new_tokens=128, n_prompts=2,
                         temperature=0.0),
    # `ar` beside HF transformers and llama.cpp on the same prompt ids, greedy (launch/peers.py):
    # llama.cpp runs our weights at F32 (first: python -m launch.convert --out=smollm2_f32.gguf).
    "peers": dict(methods="ar", peers="hf,llamacpp", llamacpp_gguf="smollm2_f32.gguf",
                  prompt_tokens="512,2048,7680", max_new_tokens=128, n_prompts=2, time_levels=False,
                  temperature=0.0),
    # `ar` beside llama.cpp with its KV cache in f16 (its default) and in f32 (ours): run once as
    # is and once with --key_dtype=bfloat16 (our keys in 16 bits).
    "peers_caches": dict(methods="ar", peers="llamacpp", llamacpp_gguf="smollm2_f32.gguf",
                         llamacpp_cache="f16,f32", prompt_tokens="512,2048,7680", max_new_tokens=128,
                         n_prompts=3, time_levels=False, temperature=0.0),
    # The planner's predictions against measurement (profiles measured on first use).
    "planner": dict(methods=PLANNER, draft=DRAFT, predict=True, prompt_tokens="2048,4096",
                    max_new_tokens=128, n_prompts=2, time_levels=False, temperature=0.0),
    "planner_sampled": dict(methods=PLANNER, draft=DRAFT, predict=True, prompt_tokens="2048",
                            max_new_tokens=128, n_prompts=2, time_levels=False, **SAMPLED),
    "planner_eagle": dict(methods=PLANNER_EAGLE, draft=DRAFT, feature_draft=EAGLE, predict=True,
                          prompt_tokens="512,2048", max_new_tokens=128, n_prompts=2, time_levels=False,
                          temperature=0.0),
    "planner_eagle_sampled": dict(methods=PLANNER_EAGLE, draft=DRAFT, feature_draft=EAGLE, predict=True,
                                  prompt_tokens="512,2048", max_new_tokens=128, n_prompts=2,
                                  time_levels=False, **SAMPLED),
    "quick": dict(methods="ar,sd/ngram/4", prompt_tokens="128", max_new_tokens=16, n_prompts=1),
}


def get_config(suite: str = "readme") -> config_dict.ConfigDict:
  if suite not in SUITES:
    raise ValueError(f"unknown benchmark suite {suite!r}; expected one of {sorted(SUITES)}")
  return config_dict.ConfigDict(SUITES[suite])
