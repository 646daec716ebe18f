"""Published EAGLE-3 drafts (heads/eagle3.py) in both formats, against vLLM's speculators package
(test-only): the same logits at every step of a chain (its training-time test-time-training
steps are drafting along a chain), the EAGLE authors' folder read as speculators' converter
reads it, ar's tokens from chains and EAGLE-2 trees over a draft vocabulary, and each broken
folder named in one line."""

import json

import jax
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.proposals.greedy import GreedyTokenProposalConfig

from hitree_jax import methods
from hitree_jax.cache.full import KVCache
from hitree_jax.decode import engine
from hitree_jax.errors import UsageError
from hitree_jax.heads import eagle3, saved
from hitree_jax.loading import load_model

E, VOCAB, DRAFT_VOCAB, LAYERS = 64, 97, 40, 8
AUX = [2, 4, 5]   # the EAGLE authors' default for 8 layers: the inputs of layers 2, L/2, L-3
SHAPE = dict(vocab_size=VOCAB, hidden_size=E, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def perturb(model, seed, scale=0.3):
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1 and torch.isfinite(p).all():
        p.add_(scale * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(transformers' Llama target and its folder, speculators' Eagle3DraftModel for it and its
  folder in speculators' format, its target ids)."""
  torch.manual_seed(0)
  target = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=LAYERS, initializer_range=0.1,
                                                                   **SHAPE)).eval()
  perturb(target, 1)
  target_folder = tmp_path_factory.mktemp("target")
  target.save_pretrained(target_folder)
  layer = transformers.LlamaConfig(num_hidden_layers=1, **SHAPE)
  layer._attn_implementation = "eager"
  config = Eagle3SpeculatorConfig(
      transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=AUX,
      speculators_config=SpeculatorsConfig(
          algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
          default_proposal_method="greedy", verifier=VerifierConfig.from_config(target.config, name_or_path=None)))
  torch.manual_seed(2)
  draft = Eagle3DraftModel(config).eval()
  ids = np.sort(np.random.default_rng(0).choice(VOCAB, DRAFT_VOCAB, replace=False))
  with torch.no_grad():
    draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    draft.lm_head.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    draft.verifier_lm_head.weight.zero_()
    for name, p in draft.named_parameters():
      if p.ndim == 2 and name.startswith(("fc", "layers")):
        p.mul_(3.0)   # weights of a trained draft's scale: its logits are far from uniform
  perturb(draft, 4)
  t2d = torch.zeros(VOCAB, dtype=torch.bool)
  t2d[ids] = True
  draft.load_vocab_mappings(t2d, torch.tensor(ids - np.arange(DRAFT_VOCAB)))
  folder = tmp_path_factory.mktemp("eagle3")
  draft.save_pretrained(folder)
  return target, target_folder, draft, folder, ids


def aux_states(target, tokens):
  """[1, T, 3E]: the inputs of the AUX layers at each position (HF's hidden_states[i])."""
  with torch.no_grad():
    states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
  return torch.cat([states[i] for i in AUX], dim=-1)


def test_every_chain_step_gives_speculators_logits(pair):
  """speculators' forward runs three test-time-training steps: step k feeds position t the
  token k places after it and the state step k-1 made there, attending to the prefix and to
  its own earlier steps: drafting along a chain. Ours, step by step, gives the same logits."""
  target, target_folder, draft, folder, ids = pair
  tokens = np.random.default_rng(1).integers(0, VOCAB, size=12).tolist()
  aux = aux_states(target, tokens)
  shifted = torch.cat([torch.zeros(1, 1, 3 * E), aux[:, :-1]], dim=1)   # token t reads the states of t-1
  captured = []
  hook = draft.lm_head.register_forward_hook(lambda module, args, out: captured.append(out[0].detach().numpy()))
  with torch.no_grad():
    draft(hidden_states=shifted, input_ids=torch.tensor([tokens]), document_ids=torch.zeros(1, 12, dtype=torch.long),
          ttt_steps=3)
  hook.remove()
  model = load_model(str(target_folder))
  meta, params, vocab = saved.load(str(folder), model.params, model.config, "eagle3")
  drafter = saved.drafter(meta, model.config)
  assert meta["format"] == "speculators" and drafter.taps == (1, 3, 4) and str(drafter) == "eagle3"
  assert vocab.size == DRAFT_VOCAB + 1 and (vocab.target_ids[1:] == ids).all()
  own = {k: v for k, v in params.items() if k != "embedding"}   # what memory_plan counts: its own weights
  assert jax.tree.map(lambda x: (x.shape, x.dtype), drafter.abstract_heads(model.config)) == jax.tree.map(
      lambda x: (x.shape, x.dtype), own)
  net, config, t = drafter.net, drafter.config, len(tokens)
  cache = KVCache.init(config, 1, 3 * t)
  embedding = model.params["embed_tokens"]["embedding"]
  state, fed = net.fuse(params, shifted.numpy()), np.asarray([tokens])
  slot = np.arange(3 * t)
  for step in range(3):
    # position t sees the prefix's first-step slots (<= t) and its own slot of every step so far
    attend = ((slot[None, :] < t) & (slot[None, :] <= np.arange(t)[:, None])) | (
        (slot[None, :] >= t) & (slot[None, :] % t == np.arange(t)[:, None]) & (slot[None, :] < (step + 1) * t))
    state, cache = net.features(params, config, embedding, fed, state, np.arange(t)[None] + step, cache,
                                attend[None], write_at=np.array([step * t]))
    logits = np.asarray(net.logits(params, state, True))[0, :, 1:]                  # OTHER dropped
    np.testing.assert_allclose(logits, captured[step], atol=1e-4, rtol=0)
    fed = np.concatenate([fed[:, 1:], np.zeros((1, 1), int)], axis=1)               # teacher forcing
    if step == 0:
      assert len({row.argmax() for row in logits}) > 3    # the draft's guesses depend on the context


@pytest.mark.slow
def test_the_authors_folder_reads_as_speculators_converter_reads_it(pair, tmp_path):
  """The EAGLE authors publish `midlayer.*` in pytorch_model.bin (a pickle, refused until
  launch.convert rewrites it) and a config of the layer (LlamaForCausalLMEagle3); speculators'
  converter turns that into its format; every folder loads to the same draft."""
  target, target_folder, draft, folder, ids = pair
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  state = safetensors.torch.load_file(str(folder / "model.safetensors"))
  torch.save({k.replace("layers.0.", "midlayer."): v for k, v in state.items()}, pickled / "pytorch_model.bin")
  (pickled / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": E, "intermediate_size": 96,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": VOCAB,
      "draft_vocab_size": DRAFT_VOCAB}))
  with pytest.raises(UsageError, match=r"pytorch_model.bin is a pickle.*launch.convert --eagle3="):
    saved.read_meta(str(pickled), "eagle3")
  authors = tmp_path / "authors"   # as published, rewritten by launch.convert --eagle3
  assert eagle3.rewrite_pickle(pickled, authors) == authors / "model.safetensors"
  converted = tmp_path / "converted"
  Eagle3Converter().convert(authors, converted, base_model=str(target_folder), validate=False,
                            eagle_aux_hidden_state_layer_ids=AUX)
  model = load_model(str(target_folder))
  loaded = {name: saved.load(str(path), model.params, model.config, "eagle3") for name, path in
            (("authors", authors), ("converted", converted), ("speculators", folder))}
  assert loaded["authors"][0]["format"] == "eagle" and loaded["converted"][0]["format"] == "speculators"
  drafters = {name: saved.drafter(meta, model.config) for name, (meta, _, _) in loaded.items()}
  assert len(set(drafters.values())) == 1   # the authors' default taps are speculators' AUX here
  for name in ("authors", "converted"):
    for a, b in zip(jax_leaves(loaded[name][1]), jax_leaves(loaded["speculators"][1])):
      np.testing.assert_array_equal(a, b)
    assert (loaded[name][2].target_ids == loaded["speculators"][2].target_ids).all()


def jax_leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow   # the fast tier runs EAGLE-3's net (above) and EagleDrafter's trees (test_heads)
@pytest.mark.parametrize("method", ["tree/eagle3:{}/dynamic:6,3", "sd/eagle3:{}/3", "tree/eagle3:{},iid/kary:2x2"])
def test_chains_and_trees_decode_ar_tokens(pair, method):
  _, target_folder, _, folder, _ = pair
  model = load_model(str(target_folder))
  spec = methods.parse_method(method.format(folder)).load_draft(model.config, model.params)
  prompts = [np.random.default_rng(5).integers(0, VOCAB, size=n).tolist() for n in (9, 14)]
  expected = engine.generate(model.params, model.config, prompts, max_new_tokens=20, stop_at_eos=False)
  got = spec.generate(model.params, model.config, prompts, max_new_tokens=20, stop_at_eos=False)
  assert got.tokens == expected.tokens


def test_broken_or_foreign_drafts_are_named(pair, tmp_path):
  _, target_folder, _, folder, _ = pair
  model = load_model(str(target_folder))
  with pytest.raises(UsageError, match=r"was trained for another target: hidden_size 64 \(this target: 128\)"):
    saved.check_target(saved.read_meta(str(folder), "eagle3"), model.config.replace(hidden_size=128), folder)
  vocab = model.config.vocab_size
  with pytest.raises(UsageError, match=rf"another target: target_vocab_size {vocab} \(this target: {vocab + 1}\)"):
    saved.load(str(folder), model.params, model.config.replace(vocab_size=vocab + 1), "eagle3")
  broken = tmp_path / "broken"
  broken.mkdir()
  hf = json.loads((folder / "config.json").read_text())
  state = safetensors.numpy.load_file(str(folder / "model.safetensors"))
  for config_change, weights_change, message in [
      ({"fc_norm": True}, None, "fc_norm=true is not supported"),
      ({"eagle_aux_hidden_state_layer_ids": [0, 4, 5]}, None, "layer 0's input"),
      ({}, lambda s: s.pop("layers.0.hidden_norm.weight"), "lacks layers.0.hidden_norm.weight"),
      ({}, lambda s: s.update({"fc.weight": np.zeros((64, 64), np.float32)}), r"fc.weight has shape \(64, 64\)"),
      ({}, lambda s: s.update({"extra": np.zeros(3, np.float32)}), "extra: a tensor this EAGLE-3 draft does not use")]:
    (broken / "config.json").write_text(json.dumps({**hf, **config_change}))
    changed = dict(state)
    if weights_change:
      weights_change(changed)
    safetensors.numpy.save_file(changed, str(broken / "model.safetensors"))
    with pytest.raises(UsageError, match=message):
      saved.load(str(broken), model.params, model.config, "eagle3")
  with pytest.raises(UsageError, match=r"holds eagle3 heads, not a model: use --draft=eagle3:"):
    load_model(str(folder))
