"""Llama-3.1-8B-Instruct with the EAGLE authors' EAGLE-3 draft, for launch.plan_memory and
launch.level_cost (shapes only).

  python -m launch.plan_memory --shapes=configs/llama3_8b_eagle3.py --topology=v5e:2x4
  python -m launch.level_cost --shapes=configs/llama3_8b_eagle3.py --topology=v6e:1x1 \
      --acceptance_length=configs/acceptance/eagle3_llama3.1_8b.json

The draft is read from its config.json alone (configs/drafters/eagle3-llama3.1-8b: the shape
fields of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config; no weights): one decoder layer at the
target's width reading three of its layers, and an LM head over 32,000 draft ids mapped to the
target's 128,256. It drafts EAGLE-2's dynamic tree of 60 nodes, 8 deep: the setting of
EAGLE-3's paper (arXiv:2503.01840, Appendix A), whose acceptance lengths
configs/acceptance/eagle3_llama3.1_8b.json holds. A chat of 32K tokens: `--shapes.prompt_tokens`
changes it (the target's context is 128K).
"""

import pathlib
import runpy

from ml_collections import config_dict

HERE = pathlib.Path(__file__).resolve().parent
DRAFT = HERE / "drafters" / "eagle3-llama3.1-8b"


def get_config() -> config_dict.ConfigDict:
  llama3_8b = runpy.run_path(str(HERE / "llama3_8b_128k.py"))["get_config"]().target.to_dict()  # its shape
  return config_dict.ConfigDict(dict(
      target=llama3_8b,
      levels=f"eagle3:{DRAFT}/dynamic:60,8",
      prompt_tokens=32512, max_new_tokens=256, batch=1))
