"""Decoding method presets for launch.generate and launch.benchmark.

  python -m launch.generate --config=configs/methods.py:sequoia --text=austen
  python -m launch.generate --config=configs/methods.py:sd --config.gamma=3 --text=austen

Each preset sets the flags of the same names (--method, --draft, --gamma, --tree,
--budget, --sinks, --window, --gamma1, --gamma2, --levels);
a flag given on the command line wins over the preset. The separate draft is the
distilled SmolLM2 draft shipped in drafts/ (see configs/models.py for pairs).
"""

from ml_collections import config_dict

DRAFT = "drafts/smollm2-draft.gguf"

PRESETS = {
    # autoregressive decoding: the baseline every speedup is measured against
    "ar": dict(method="ar"),
    # Leviathan et al.: a chain of gamma draft tokens, verified in one target forward
    "sd": dict(method="sd", draft=DRAFT, gamma=2),
    # prompt lookup: the chain is copied from the latest earlier match of the suffix
    "ngram": dict(method="sd", draft="ngram:3", gamma=4),
    # a binary tree drafted by the target's own first 8 layers (no extra weights or cache)
    "self_tree": dict(method="tree", draft="self:8", tree="kary:2x2"),
    # Sequoia: the best 8-node tree (depth <= 4) for the draft's measured acceptance profile
    "sequoia": dict(method="tree", draft=DRAFT, tree="sequoia:8,4"),
    # EAGLE-2: each round keeps the 10 most probable of the draft's candidates, 4 deep
    "dynamic": dict(method="tree", draft=DRAFT, tree="dynamic:10,4"),
    # the target over a 1024-slot retrieval cache drafts 6 tokens for itself ("retrieval
    # without hierarchy" in TriForce's README)
    "retrieval": dict(method="retrieval", gamma=6, budget=1024),
    # TriForce: the draft (StreamingLLM cache, 16 sinks + 234 recent) proposes gamma1 = 1 token to
    # the target's retrieval level, which buffers gamma2 = 6 for the target
    "triforce": dict(method="triforce", draft=DRAFT, budget=1024, sinks=16, window=234, gamma1=1,
                     gamma2=6),
    # HiTree: the same with a binary tree of depth 4 at the bottom, and gamma2 = 12
    "hitree": dict(method="hitree", draft=DRAFT, tree="kary:2x4", budget=1024, sinks=16, window=234,
                   gamma2=12),
    # HSD, any stack: n-gram lookup -> the draft -> the retrieval level -> the target
    "hsd4": dict(method="hsd", draft=DRAFT, levels="ngram:3/chain:2+draft/3+retrieval:1024/6"),
}


def get_config(preset: str = "sd") -> config_dict.ConfigDict:
  if preset not in PRESETS:
    raise ValueError(f"unknown method preset {preset!r}; expected one of {sorted(PRESETS)}")
  return config_dict.ConfigDict(PRESETS[preset])
