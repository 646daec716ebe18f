"""Qwen2, Qwen3, Mistral and a biased Llama from HF folders, against transformers' own models (tiny random
configs), and the one-line refusals of what the model does not implement."""

import json
import re

import numpy as np
import pytest
import torch
import transformers

from hitree_jax import methods
from hitree_jax.decode import engine
from hitree_jax.loading import load_model
from hitree_jax.loading.hf import params_from_state_dict
from hitree_jax.model.config import ModelConfig
from tests.helpers import our_logits

torch.set_num_threads(2)

SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, initializer_range=0.1)  # wide init: greedy without near-ties
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}
# What each family's folder is saved with: a tied Qwen2 (as Qwen2-0.5B), a Mistral whose window
# holds the test's 256 positions, a Llama with HF's attention_bias (q, k, v and o), a tied Qwen3
# whose head_dim is not hidden_size / heads (as Qwen3-0.6B's 128 of 1024 / 16).
SETTINGS = {"qwen2": dict(tie_word_embeddings=True, eos_token_id=None),
            "qwen3": dict(tie_word_embeddings=True, head_dim=24, eos_token_id=None),
            "mistral": dict(sliding_window=256, eos_token_id=2),
            "llama": dict(attention_bias=True, eos_token_id=2)}
PROMPTS = [[3, 8, 13, 21, 34, 55, 89, 44, 33, 77], [5, 12, 70, 1, 9]]


def tiny_hf(family, seed=0, **changes):
  """A tiny random transformers model, its norms and biases perturbed: transformers starts them at
  1 and 0, where a swapped norm or a dropped bias would not show."""
  config_class, model_class = FAMILIES[family]
  torch.manual_seed(seed)
  model = model_class(config_class(**{**SHAPE, **SETTINGS[family], **changes})).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
  """(family, transformers model, its folder written by save_pretrained: safetensors)."""
  model = tiny_hf(request.param)
  folder = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(folder)
  assert list(folder.glob("*.safetensors"))
  return request.param, model, folder


def test_logits_match_transformers(saved):
  family, hf, folder = saved
  model = load_model(str(folder))
  c = model.config
  assert (c.qkv_bias, c.o_bias) == {"qwen2": (True, False), "qwen3": (False, False),
                                    "mistral": (False, False), "llama": (True, True)}[family]
  biases = [n for n, p in hf.named_parameters() if n.endswith(".bias")]
  assert len(biases) == 2 * {"qwen2": 3, "qwen3": 0, "mistral": 0, "llama": 4}[family]
  assert c.qk_norm == (family == "qwen3") and (family != "qwen3" or c.head_dim * c.num_heads != c.hidden_size)
  tokens = list(np.random.default_rng(0).integers(0, 97, 200))
  with torch.no_grad():
    expected = hf(torch.tensor([tokens])).logits.numpy()[0]
  np.testing.assert_allclose(our_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_a_gguf_reads_back_in_transformers_and_here(family, tmp_path):
  """save_gguf writes each family as llama.cpp's converter does: a Qwen3 as architecture qwen3
  (its q/k norms, its head width as attention.key_length, q/k rows as HF has them), a Qwen2 as
  qwen2 (q/k/v biases, rows as HF has them), a Llama as llama (q/k rows permuted).
  transformers' own GGUF reader and load_gguf each read back the model: the logits of the
  transformers model it was made from. (transformers reads a llama GGUF's attention biases into
  no model, so the Llama here has none; tests/test_loading.py reads them back.)"""
  import gguf
  from hitree_jax.loading.gguf import load_gguf, save_gguf
  # transformers reads no attention.key_length for qwen3 and takes Qwen3Config's 128
  changes = {"qwen3": dict(head_dim=128), "llama": dict(attention_bias=False)}.get(family, {})
  hf = tiny_hf(family, **changes)
  hf.save_pretrained(tmp_path / "hf")
  ours = load_model(str(tmp_path / "hf"))
  path = save_gguf(tmp_path / "m.gguf", ours.config, ours.params, quantize=False)
  assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == family
  tokens = list(np.random.default_rng(1).integers(0, 97, 64))
  with torch.no_grad():
    expected = hf(torch.tensor([tokens])).logits.numpy()[0]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                                dtype=torch.float32).eval()
    np.testing.assert_allclose(theirs(torch.tensor([tokens])).logits.numpy()[0], expected, atol=2e-4, rtol=1e-4)
  config, params, _ = load_gguf(path)
  assert config == ours.config.replace(eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id)
  from hitree_jax.loading import LoadedModel
  np.testing.assert_allclose(our_logits(LoadedModel(config, params, path), tokens), expected, atol=2e-4, rtol=1e-4)


def hf_greedy(hf, prompt, new):
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("saved", ["qwen2", "qwen3", "mistral"], indirect=True)
@pytest.mark.parametrize("spec", ["ar", "sd/ngram/3", "sd/self:1/3"])
def test_greedy_generation_equals_transformers_generate(saved, spec):
  _, hf, folder = saved
  model = load_model(str(folder))
  expected = [hf_greedy(hf, prompt, 24) for prompt in PROMPTS]
  method = methods.method(spec).load_draft(model.config, model.params)
  got = method.generate(model.params, model.config, PROMPTS, max_new_tokens=24, stop_at_eos=False)
  assert got.tokens == expected
  if spec != "ar":
    assert got.target_forwards < 24  # it really speculated: some drafts were accepted


def test_a_mistral_window_caps_the_positions(tmp_path):
  hf = tiny_hf("mistral", sliding_window=64)
  hf.save_pretrained(tmp_path)
  model = load_model(str(tmp_path))
  assert model.config.max_position_embeddings == 64
  tokens = list(range(3, 67))  # the whole window: still full attention
  with torch.no_grad():
    expected = hf(torch.tensor([tokens])).logits.numpy()[0]
  np.testing.assert_allclose(our_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)
  with pytest.raises(ValueError, match="context of 64"):
    engine.generate(model.params, model.config, [list(range(3, 50))], max_new_tokens=20)
  plain = {**hf.config.to_dict(), "sliding_window": None}
  assert ModelConfig.from_hf(plain).max_position_embeddings == 256


# ---- refusals, each in one line naming what is wrong ----

def write_config(folder, **changes):
  """A Llama folder's config.json with changes (a value None: the key removed)."""
  hf = {**tiny_hf("llama", attention_bias=False).config.to_dict(), **changes}
  (folder / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))


def test_an_unknown_model_type_is_named(tmp_path):
  write_config(tmp_path, model_type="gemma")
  with pytest.raises(ValueError, match=r"model_type 'gemma' is not supported; supported: llama, "
                                       r"mistral, qwen2, qwen3$"):
    load_model(str(tmp_path))


@pytest.mark.parametrize("key", ["hidden_size", "model_type", "num_attention_heads"])
def test_a_missing_config_key_is_named_with_the_file(tmp_path, key):
  write_config(tmp_path, **{key: None})
  with pytest.raises(ValueError, match=f"^config.json at {re.escape(str(tmp_path))} lacks '{key}'$"):
    load_model(str(tmp_path))


@pytest.mark.parametrize("changes,named", [
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=1,
          max_position_embeddings=256), "use_sliding_window.* in layers 1-1 "),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=128,
          layer_types=["sliding_attention", "full_attention"]), "in layers 0-0 "),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=128,
          layer_types=["full_attention", "sliding_attention"]), "in layers 1-1 "),
])
def test_settings_the_model_does_not_implement_are_named(changes, named):
  hf = {**tiny_hf("llama").config.to_dict(), **changes}
  with pytest.raises(ValueError, match=named):
    ModelConfig.from_hf(hf)
  fine = {**hf, "mlp_bias": False, "hidden_act": "silu", "quantization_config": None,
          "use_sliding_window": False}
  ModelConfig.from_hf(fine)  # the same config without that setting loads


def test_a_qwen2_window_from_max_window_layers_on_past_the_last_layer_is_full_attention():
  """Qwen2-7B's shape: use_sliding_window with max_window_layers = its layers slides no layer."""
  hf = {**tiny_hf("qwen2").config.to_dict(), "use_sliding_window": True, "sliding_window": 128,
        "max_window_layers": 2, "layer_types": None}
  assert ModelConfig.from_hf(hf).max_position_embeddings == 256


def state_and_config(family):
  hf = tiny_hf(family)
  config = ModelConfig.from_hf(hf.config.to_dict())
  return {k: v.detach().numpy() for k, v in hf.state_dict().items()}, config


def test_a_tensor_the_model_does_not_use_is_named():
  state, config = state_and_config("qwen2")
  with pytest.raises(ValueError, match=r"^checkpoint: model.layers.0.self_attn.k_proj.bias: a tensor "
                                       r"this model does not use \(and 5 more\)$"):
    params_from_state_dict(state, config.replace(qkv_bias=False))  # a Qwen2 read as a Llama
  extra = dict(state, **{"model.layers.1.mlp.gate_proj.bias": np.zeros(96, np.float32)})
  with pytest.raises(ValueError, match="model.layers.1.mlp.gate_proj.bias: a tensor"):
    params_from_state_dict(extra, config)
  # what transformers saves beside the weights, or ties to them, is no error
  tolerated = dict(state, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
                             "lm_head.weight": state["model.embed_tokens.weight"]})
  params_from_state_dict(tolerated, config)


def test_qwen3s_norms_are_named_where_they_are_missing_or_not_used():
  state, config = state_and_config("qwen3")
  with pytest.raises(ValueError, match=r"^checkpoint: model.layers.0.self_attn.k_norm.weight: a tensor "
                                       r"this model does not use \(and 3 more\)$"):
    params_from_state_dict(state, config.replace(qk_norm=False))  # a Qwen3 read as a Llama
  del state["model.layers.1.self_attn.q_norm.weight"]
  with pytest.raises(ValueError, match=r"^checkpoint lacks model.layers.1.self_attn.q_norm.weight$"):
    params_from_state_dict(state, config)


def test_a_missing_tensor_is_named(tmp_path):
  state, config = state_and_config("mistral")
  del state["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match=r"^checkpoint lacks model.layers.1.mlp.up_proj.weight$"):
    params_from_state_dict(state, config)
  hf = tiny_hf("llama", attention_bias=False)
  hf.save_pretrained(tmp_path)
  write_config(tmp_path, attention_bias=True)  # says biased, holds no biases
  lacks = re.escape(f"{tmp_path} lacks model.layers.0.self_attn.q_proj.bias (and 7 more)")
  with pytest.raises(ValueError, match=f"^{lacks}$"):
    load_model(str(tmp_path))


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes():
  state, config = state_and_config("qwen3")
  wrong = dict(state, **{"model.layers.1.mlp.up_proj.weight": np.zeros((96, 32), np.float32)})
  with pytest.raises(ValueError, match=r"^checkpoint: model.layers.1.mlp.up_proj.weight has shape \(96, 32\); "
                                       r"this config expects \(96, 64\)$"):
    params_from_state_dict(wrong, config)
  with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight has shape \(96, 64\); "
                                       r"this config expects \(64, 64\)"):
    params_from_state_dict(state, config.replace(head_dim=16))   # a config of other heads
