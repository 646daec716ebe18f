"""FasterDecoding's published Medusa heads (heads/medusa_format.py), against the authors' own
package (medusa-llm, test-only): the same logits from the same folder, exact decoding with them,
their pickle converted by launch.convert, and each broken folder named in one line."""

import json
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from medusa.model.medusa_model import MedusaConfig, MedusaModel

from hitree_jax import methods
from hitree_jax.decode import engine
from hitree_jax.errors import UsageError
from hitree_jax.heads import medusa, medusa_format, saved
from hitree_jax.loading import load_model, resolve
from hitree_jax.tokenizer import load_tokenizer

from tests.helpers import REPO

HEADS = 3
PROMPTS = [[3, 8, 13, 21, 34, 55, 89, 44, 33, 77], [5, 12, 70, 1, 9]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """(a tiny transformers Llama, its folder, a folder with a tokenizer for MedusaModel to load)."""
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)).eval()
  folder = tmp_path_factory.mktemp("target")
  hf.save_pretrained(folder)
  tokenizer = tmp_path_factory.mktemp("tokenizer")
  load_tokenizer(resolve("smollm2")).save_pretrained(tokenizer)
  return hf, folder, tokenizer


def reference(target, layers: int, seed: int = 1) -> MedusaModel:
  """The authors' MedusaModel over the target, its heads random (they start as identities)."""
  hf, _, tokenizer = target
  model = MedusaModel(hf, medusa_num_heads=HEADS, medusa_num_layers=layers,
                      base_model_name_or_path=str(tokenizer))
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.medusa_head.parameters():
      p.copy_(0.2 * torch.randn(p.shape, generator=generator))
  return model


def write_published(model: MedusaModel, folder, pickle: bool = False):
  """A folder as the Medusa repository publishes one: config.json and the heads' state dict."""
  folder.mkdir(parents=True, exist_ok=True)
  MedusaConfig(medusa_num_heads=model.medusa, medusa_num_layers=model.medusa_num_layers,
               base_model_name_or_path="tiny-llama").save_pretrained(folder)
  state = model.medusa_head.state_dict()
  if pickle:
    torch.save(state, folder / "medusa_lm_head.pt")
  else:   # the L copies of a head's one block share storage, which safetensors refuses
    safetensors.torch.save_file({k: v.clone().contiguous() for k, v in state.items()},
                                str(folder / "medusa_lm_head.safetensors"))
  return folder


@pytest.mark.parametrize("layers", [1, 2])
def test_published_heads_give_the_authors_logits(target, tmp_path, layers):
  hf, folder, _ = target
  ref = reference(target, layers)
  heads = write_published(ref, tmp_path / "heads")
  ids = torch.tensor(np.random.default_rng(0).integers(0, 97, size=(2, 40)))
  with torch.no_grad():
    expected = ref(input_ids=ids).numpy()                              # [K, B, T, V]
    hidden = hf.model(input_ids=ids)[0].numpy()                        # [B, T, E], final-normed
  ours = load_model(str(folder))
  meta, params, vocab = saved.load(str(heads), ours.params, ours.config, "medusa")
  assert vocab is None and meta["medusa_heads"] == HEADS and meta["medusa_layers"] == layers
  assert params["blocks"].shape == (HEADS, layers, 64, 64) and params["heads"].shape == (HEADS, 64, 97)
  got = np.asarray(medusa.logits(params, hidden, False))               # [B, T, K, V]
  np.testing.assert_allclose(got, expected.transpose(1, 2, 0, 3), atol=1e-4, rtol=0)


@pytest.mark.slow   # the fast tier runs the heads (above) and Medusa's trees (test_heads)
@pytest.mark.parametrize("spec", ["tree/medusa:{}/kary:2x2", "sd/medusa:{}/3", "tree/medusa:{}/dynamic:6,3"])
def test_published_heads_decode_ar_tokens(target, tmp_path, spec):
  _, folder, _ = target
  heads = write_published(reference(target, 1), tmp_path / "heads")
  model = load_model(str(folder))
  method = methods.parse_method(spec.format(heads)).load_draft(model.config, model.params)
  assert method.stack.drafter.published and str(method.stack.drafter) == f"medusa:{HEADS}"
  expected = engine.generate(model.params, model.config, PROMPTS, max_new_tokens=16, stop_at_eos=False)
  got = method.generate(model.params, model.config, PROMPTS, max_new_tokens=16, stop_at_eos=False)
  assert got.tokens == expected.tokens


def test_a_pickle_is_refused_until_convert_rewrites_it(target, tmp_path):
  hf, folder, _ = target
  ref = reference(target, 2)
  pickled = write_published(ref, tmp_path / "pickled", pickle=True)
  model = load_model(str(folder))
  with pytest.raises(UsageError, match=r"medusa_lm_head.pt is a pickle, which is never opened here.*"
                                       r"python -m launch.convert --medusa="):
    saved.load(str(pickled), model.params, model.config, "medusa")
  # the command the error names, as a user runs it
  proc = subprocess.run([sys.executable, "-m", "launch.convert", f"--medusa={pickled}",
                         f"--out={tmp_path / 'converted'}"], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = tmp_path / "converted" / "medusa_lm_head.safetensors"
  direct = write_published(ref, tmp_path / "direct")
  converted = saved.load(str(out.parent), model.params, model.config, "medusa")[1]
  for name, array in saved.load(str(direct), model.params, model.config, "medusa")[1].items():
    np.testing.assert_array_equal(np.asarray(converted[name]), np.asarray(array))
  with pytest.raises(UsageError, match="expected a folder with a config.json naming medusa_num_heads"):
    medusa_format.rewrite_pickle(folder, tmp_path / "x")   # a model's folder, not heads


def test_broken_or_foreign_heads_are_named(target, tmp_path):
  hf, folder, _ = target
  model = load_model(str(folder))
  heads = write_published(reference(target, 1), tmp_path / "heads")
  # heads trained for a target of another width
  wide = model.config.replace(hidden_size=128, intermediate_size=128)
  with pytest.raises(UsageError, match=r"was trained for another target: hidden_size 64 \(this target: 128\)"):
    saved.load(str(heads), model.params, wide, "medusa")
  vocab = model.config.vocab_size   # or of another vocabulary
  with pytest.raises(UsageError, match=rf"another target: target_vocab_size {vocab} \(this target: {vocab + 1}\)"):
    saved.load(str(heads), model.params, model.config.replace(vocab_size=vocab + 1), "medusa")
  # a tensor missing, one of the wrong shape, one left over
  weights = heads / "medusa_lm_head.safetensors"
  state = safetensors.torch.load_file(str(weights))
  for change, message in [
      (lambda s: s.pop("1.0.linear.bias"), r"lacks 1.0.linear.bias$"),
      (lambda s: s.update({"2.0.linear.weight": torch.zeros(64, 32)}),
       r"2.0.linear.weight has shape \(64, 32\), expected \(64, 64\)"),
      (lambda s: s.update({"3.0.linear.weight": torch.zeros(64, 64)}), r"3.0.linear.weight: a tensor these 3 heads")]:
    broken = dict(state)
    change(broken)
    safetensors.torch.save_file(broken, str(weights))
    with pytest.raises(UsageError, match=message):
      saved.load(str(heads), model.params, model.config, "medusa")
  # a folder of heads is not a model, and --model says which flag it belongs to
  with pytest.raises(UsageError, match=r"holds medusa heads, not a model: use --draft=medusa:"):
    load_model(str(heads))
  assert json.loads((heads / "config.json").read_text())["medusa_num_heads"] == HEADS
