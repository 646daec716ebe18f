"""Benchmark suites for launch.benchmark.

  python -m launch.benchmark --config=configs/benchmarks.py:readme --out=results.json

`readme` is the table in the README; `long` the long-context prompts the
hierarchy is for (SmolLM2 has 8192 positions); `quick` a smoke test.
"""

from ml_collections import config_dict

DRAFT = "drafts/smollm2-draft.gguf"
SAMPLED = dict(temperature=0.6, top_p=0.9)  # TriForce's and HiTree's setting

SUITES = {
    "readme": dict(methods=f"ar,sd/{DRAFT}/2,sd/{DRAFT}/3,tree/{DRAFT}/sequoia:8,4,"
                           f"tree/{DRAFT}/dynamic:4,3,sd/ngram/4",
                   prompt_tokens="512,2048", max_new_tokens=128, n_prompts=2, **SAMPLED),
    # the hierarchy's setting (README, second table): budget 1024, gamma2 6
    "long": dict(methods=f"ar,tree/{DRAFT}/dynamic:4,3,retrieval/6,triforce/{DRAFT},"
                         f"hitree/{DRAFT}/kary:2x2,hsd/{DRAFT}@streaming:16x234/kary:2x4+retrieval:1024/12",
                 budget=1024, gamma2=6, prompt_tokens="7680", max_new_tokens=128, n_prompts=1,
                 **SAMPLED),
    "quick": dict(methods="ar,sd/ngram/4", prompt_tokens="128", max_new_tokens=16, n_prompts=1),
}


def get_config(suite: str = "readme") -> config_dict.ConfigDict:
  if suite not in SUITES:
    raise ValueError(f"unknown benchmark suite {suite!r}; expected one of {sorted(SUITES)}")
  return config_dict.ConfigDict(SUITES[suite])
