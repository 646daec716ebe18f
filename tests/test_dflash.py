"""z-lab's DFlash block drafts (heads/dflash.py, dflash_format.py), against the authors' own package
(dflash, test-only) on a tiny random Qwen3 target: the same block logits from the same folder, the
same acceptance round by round as their decoder, ar's tokens from chains and trees, and each
broken folder named in one line."""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from dflash import model as reference

from hitree_jax import methods
from hitree_jax.cache.full import KVCache
from hitree_jax.decode import engine
from hitree_jax.errors import UsageError
from hitree_jax.heads import dflash, dflash_format, saved
from hitree_jax.heads.drafter import DFlashDrafter
from hitree_jax.loading import load_model

VOCAB, BLOCK, TAPS = 16, 4, [0, 2]   # a small vocabulary: random drafts are right often enough to count
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
             rope_theta=10000.0, initializer_range=0.1)


def perturb_norms(model, seed):
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(the target: transformers' Qwen3 and its folder, the authors' DFlashDraftModel and its folder)."""
  torch.manual_seed(0)
  target = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=4, **SHAPE)).eval()
  perturb_norms(target, 1)
  target_folder = tmp_path_factory.mktemp("target")
  target.save_pretrained(target_folder)
  config = transformers.Qwen3Config(num_hidden_layers=2, **SHAPE)
  config.block_size, config.num_target_layers = BLOCK, 4
  config.dflash_config = {"mask_token_id": VOCAB - 1, "target_layer_ids": TAPS}
  torch.manual_seed(2)
  draft = reference.DFlashDraftModel(config).eval()
  perturb_norms(draft, 3)
  draft_folder = tmp_path_factory.mktemp("dflash")
  draft.save_pretrained(draft_folder)
  return target, target_folder, draft, draft_folder


def test_the_block_gives_the_authors_logits(pair):
  target, target_folder, draft, draft_folder = pair
  model = load_model(str(target_folder))
  meta, params, _ = saved.load(str(draft_folder), model.params, model.config, "dflash")
  drafter = saved.drafter(meta, model.config)
  assert drafter.taps == tuple(TAPS) and drafter.spec.block_size == BLOCK and str(drafter) == "dflash:4"
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(drafter.abstract_heads(model.config)) == shapes(params)   # what memory_plan counts
  for length in (5, 12):
    ids = torch.tensor(np.random.default_rng(length).integers(0, VOCAB - 1, size=(1, length + 1)))
    prompt, root = ids[:, :length], ids[:, length]
    with torch.no_grad():
      states = target(prompt, output_hidden_states=True).hidden_states
      context = reference.extract_context_feature(states, TAPS)                        # [1, P, 2E]
      block = torch.cat([root[:, None], torch.full((1, BLOCK - 1), VOCAB - 1)], dim=1)
      hidden = draft(target_hidden=context, noise_embedding=target.model.embed_tokens(block),
                     position_ids=torch.arange(length + BLOCK)[None])
      expected = target.lm_head(hidden[:, 1:]).numpy()                                  # [1, B-1, V]
    # ours: slot i holds the context of position i - 1 (slot 0 nothing), then the block at the root's
    cache = KVCache.init(drafter.config, 1, length + 1)
    cache = dflash.write_context(params, drafter.config, cache, context.numpy(), np.arange(length)[None],
                                 np.ones(1, np.int32)).replace(lengths=np.array([length + 1], np.int32))
    got = dflash.block_logits(params, drafter.config, drafter.spec, model.params["embed_tokens"]["embedding"],
                              root.numpy().astype(np.int32), np.array([length], np.int32),
                              ((cache.keys, cache.values, cache.lengths, dflash.first_visible(np.zeros(1, np.int32))),))
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=0)


@dataclasses.dataclass(frozen=True)
class RecordingDrafter(DFlashDrafter):
  """Our DFlash drafter, telling the host each round's root position and its block's argmax."""

  def propose(self, key, tree, inp):
    rows, _ = self._block_rows(inp)
    jax.debug.callback(lambda end, tokens: PROPOSED.append((int(end[0]) - 1, tokens[0].tolist())),
                       inp.end, jnp.argmax(rows, axis=-1), ordered=True)
    return super().propose(key, tree, inp)


PROPOSED = []


@pytest.mark.slow
def test_every_round_proposes_what_the_authors_decoder_proposes(pair, monkeypatch):
  """Greedy, with a chain of block_size - 1: the tokens are ar's and the authors' dflash_generate's,
  and every round drafts from the same root position the same block as theirs (so it read the
  same context: a slot or position off by one changes the draft)."""
  target, target_folder, draft, draft_folder = pair
  theirs = []
  compute_logits = draft.compute_logits
  monkeypatch.setattr(draft, "compute_logits",
                      lambda hidden, head: theirs.append(compute_logits(hidden, head)) or theirs[-1])
  monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)   # its timer syncs CUDA
  model = load_model(str(target_folder))
  spec = methods.parse_method(f"sd/dflash:{draft_folder}/{BLOCK - 1}").load_draft(model.config, model.params)
  recording = dataclasses.replace(spec.stack, drafter=RecordingDrafter(**vars(spec.stack.drafter)))
  new = 40
  for seed in (0, 1, 2):
    theirs.clear()
    PROPOSED.clear()
    prompt = np.random.default_rng(seed).integers(0, VOCAB - 1, size=12).tolist()
    stats = reference.dflash_generate(draft, target, torch.tensor([prompt]), new, None, return_stats=True)
    ar = engine.generate(model.params, model.config, [prompt], max_new_tokens=new, stop_at_eos=False)
    ours = engine.generate(model.params, model.config, [prompt], max_new_tokens=new, stop_at_eos=False,
                           stack=recording, draft=spec.draft)
    assert ours.tokens == ar.tokens == [stats.output_ids[0, len(prompt):].tolist()]
    starts = len(prompt) + np.cumsum([0, *stats.acceptance_lengths[:-1]])
    full = [(int(s), logits[0].argmax(-1).tolist()) for s, logits in zip(starts, theirs)
            if logits.shape[1] == BLOCK - 1]     # their last blocks are cut at max_new_tokens
    assert len(full) >= 20 and PROPOSED[:len(full)] == full
    assert len({tuple(tokens) for _, tokens in full}) > 3    # the blocks depend on their context


@pytest.mark.parametrize("method", ["tree/dflash:{}/kary:2x3",
                                    pytest.param("tree/dflash:{}/dynamic:6,3", marks=pytest.mark.slow),
                                    pytest.param("tree/dflash:{},iid/kary:2x2", marks=pytest.mark.slow)])
def test_trees_over_the_block_decode_ar_tokens(pair, method):
  """Each depth's top tokens under every parent (the block's rows, like Medusa's heads): greedy
  gives ar's tokens; with sampling, the seeded draw is reproduced by a second run."""
  _, target_folder, _, draft_folder = pair
  model = load_model(str(target_folder))
  spec = methods.parse_method(method.format(draft_folder)).load_draft(model.config, model.params)
  prompts = [np.random.default_rng(7).integers(0, VOCAB - 1, size=n).tolist() for n in (9, 14)]
  expected = engine.generate(model.params, model.config, prompts, max_new_tokens=20, stop_at_eos=False)
  got = spec.generate(model.params, model.config, prompts, max_new_tokens=20, stop_at_eos=False)
  assert got.tokens == expected.tokens and got.target_forwards < 20


def test_the_speculators_format_holds_the_same_draft(pair, tmp_path):
  """vLLM's speculators format, written by its own converter from the z-lab folder (its tapped
  layers counted from the embedding): the same drafter and weights as z-lab's, and sd over it
  decodes ar's tokens; what that format adds and this drafter does not do is named."""
  from speculators.convert.dflash.converter import DFlashConverter
  _, target_folder, _, draft_folder = pair
  folder = tmp_path / "speculators"
  DFlashConverter().convert(draft_folder, folder, base_model=str(target_folder), validate=False)
  hf = json.loads((folder / "config.json").read_text())
  assert hf["speculators_model_type"] == "dflash" and hf["aux_hidden_state_layer_ids"] == [i + 1 for i in TAPS]
  model = load_model(str(target_folder))
  (zlab_meta, zlab, _), (meta, params, _) = [saved.load(str(f), model.params, model.config, "dflash")
                                             for f in (draft_folder, folder)]
  assert (zlab_meta["format"], meta["format"]) == ("dflash", "speculators")
  assert saved.drafter(meta, model.config) == saved.drafter(zlab_meta, model.config)
  jax.tree.map(np.testing.assert_array_equal, params, zlab)
  spec = methods.parse_method(f"sd/dflash:{folder}/{BLOCK - 1}").load_draft(model.config, model.params)
  prompts = [np.random.default_rng(3).integers(0, VOCAB - 1, size=n).tolist() for n in (8, 13)]
  expected = engine.generate(model.params, model.config, prompts, max_new_tokens=16, stop_at_eos=False)
  got = spec.generate(model.params, model.config, prompts, max_new_tokens=16, stop_at_eos=False)
  assert got.tokens == expected.tokens and got.target_forwards < 16
  for change, message in [({"sample_from_anchor": True}, "sample_from_anchor=true .* is not supported"),
                          ({"draft_vocab_size": 8}, r"a reduced draft vocabulary \(draft_vocab_size=8 of 16\)"),
                          ({"aux_hidden_state_layer_ids": None}, "lacks mask_token_id or the target's layers")]:
    (folder / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(UsageError, match=message):
      saved.read_meta(str(folder), "dflash")


def test_broken_or_foreign_drafts_are_named(pair, tmp_path):
  target, target_folder, draft, draft_folder = pair
  model = load_model(str(target_folder))
  with pytest.raises(UsageError, match=r"was trained for another target: num_layers 4 \(this target: 6\)"):
    saved.check_target(saved.read_meta(str(draft_folder), "dflash"), model.config.replace(num_layers=6), draft_folder)
  meta = saved.read_meta(str(draft_folder), "dflash")
  with pytest.raises(UsageError, match=rf"target_vocab_size {VOCAB} \(this target: {VOCAB + 1}\)"):
    saved.check_target(meta, model.config.replace(vocab_size=VOCAB + 1), draft_folder)
  with pytest.raises(UsageError, match="a tree of depth 4 is deeper than the DFlash draft's block of 4"):
    methods.parse_method(f"sd/dflash:{draft_folder}/4").load_draft(model.config, model.params)
  # a target with fewer layers than the draft reads, where its config does not say how many it had
  loaded = methods.parse_method(f"sd/dflash:{draft_folder}/2").load_draft(model.config, model.params)
  with pytest.raises(UsageError, match=r"reads layers \[0, 2\] of its target; this target has 2 layers"):
    loaded.stack.drafter.check(loaded.stack.tree, model.config.replace(num_layers=2))
  folder = tmp_path / "broken"
  folder.mkdir()
  hf = json.loads((draft_folder / "config.json").read_text())
  state = safetensors.torch.load_file(str(draft_folder / "model.safetensors"))
  for config_change, weights_change, message in [
      ({"dflash_config": {"target_layer_ids": TAPS}}, None, "lacks mask_token_id or the target.s layers it reads"),
      ({"final_logit_softcapping": 30.0}, None, "final_logit_softcapping=30.0 is not supported"),
      ({"architectures": ["DFlash2DraftModel"]}, None, "DFlash2 .* is not supported"),
      ({}, lambda s: s.pop("layers.1.self_attn.k_norm.weight"), "lacks layers.1.self_attn.k_norm.weight"),
      ({}, lambda s: s.update({"fc.weight": torch.zeros(64, 64)}), r"fc.weight has shape \(64, 64\), expected \(64, 128\)"),
      ({}, lambda s: s.update({"extra.weight": torch.zeros(3)}), "extra.weight: a tensor this DFlash draft does not use")]:
    (folder / "config.json").write_text(json.dumps({**hf, **config_change}))
    broken = dict(state)
    if weights_change:
      weights_change(broken)
    safetensors.torch.save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(UsageError, match=message):
      meta = dflash_format.read_meta(folder)
      dflash_format.load_params(folder, meta)
  with pytest.raises(UsageError, match=r"holds dflash heads, not a model: use --draft=dflash:"):
    load_model(str(draft_folder))
