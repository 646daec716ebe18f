"""The --levels grammar as types (decode/spec.py): docs/methods.md's examples parse and print
back as written, the presets expand to specs that round-trip, and bad pieces are named."""

import pathlib
import re

import pytest

from hitree_jax import methods
from hitree_jax.decode import spec
from hitree_jax.decode.drafters import ModelDrafter
from hitree_jax.cache.kinds import Full, Retrieval, Streaming
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.loading import load_config, load_vocab
from hitree_jax.tree import shapes as tree_lib

DOCS = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "methods.md").read_text()


def documented_specs() -> list[str]:
  """Every concrete --levels spec in docs/methods.md: `--levels=...` and the backticked
  examples written in the grammar (placeholders in capitals left out)."""
  found = re.findall(r"--levels=(\S+)", DOCS) + re.findall(r"`([^`\s]+/[^`\s]+)`", DOCS)
  return sorted({s for s in found if not re.search(r"[A-Z]{2,}|^sd/|\[|\.py$", s)})


def test_every_documented_spec_round_trips():
  specs = documented_specs()
  assert len(specs) >= 4 and "ngram:3/chain:2+draft/3+retrieval:1024/6" in specs
  for text in specs:
    assert str(spec.parse(text)) == text


def test_a_spec_is_typed():
  triforce = spec.parse("drafts/d.gguf@streaming:16x234:reindex,iid/chain:1+retrieval:1024:64/6")
  assert triforce.drafter == spec.Level("drafts/d.gguf", Streaming(16, 234, reindex=True), "iid")
  assert triforce.drafter.kind == "draft" and triforce.tree == spec.Chain(1)
  (middle, gamma), = triforce.middles
  assert (middle.kind, middle.retrieval, middle.budget, gamma) == ("retrieval", Retrieval(1024, reselect=64), 1024, 6)
  assert spec.parse_level("eagle:drafts/e").feature_draft == ("eagle", "drafts/e")
  assert spec.parse_level("draft@full").cache == Full() and spec.parse_level("ngram").kind == "ngram"
  lookup = spec.parse("ngram:2-3/chain:4")
  assert lookup.drafter.kind == "ngram" and str(lookup) == "ngram:2-3/chain:4"
  # each kind is a typed value, parsed once, which prints as the grammar writes it
  assert lookup.drafter.source == spec.NGram(3, 2) and str(spec.NGram(3, 2)) == "ngram:2-3"
  assert spec.parse_level("ngram").source == spec.NGram() and str(spec.NGram()) == "ngram:3"
  assert spec.parse_level("self:4,iid").source == spec.SelfDraft(4)
  assert spec.parse_level("draft").source == spec.DraftModel() and str(spec.DraftModel()) == "draft"
  assert spec.parse_level("drafts/d.gguf@full").source == spec.DraftModel("drafts/d.gguf")
  assert spec.parse_level("eagle3:drafts/e").source == spec.FeatureDraft("eagle3", "drafts/e")
  assert spec.parse_level("retrieval:1024:64").source == Retrieval(1024, reselect=64)
  from hitree_jax.decode.drafters import NGramDrafter, SelfDrafter
  assert str(NGramDrafter(3, min_ngram=2)) == "ngram:2-3" and str(SelfDrafter(4)) == "self:4"
  # the cache kind prints as the grammar writes it
  assert str(Streaming(16, 234)) == "streaming:16x234"


def test_a_tree_is_typed_and_checked_before_building():
  assert spec.parse_tree("chain:4") == spec.Chain(4) == spec.parse_tree("4")
  assert (str(spec.parse_tree("4")), str(spec.Chain(4))) == ("4", "chain:4")   # printed as written
  assert spec.parse_tree(" kary:3x1 ") == spec.Kary(3, 1)
  assert spec.parse_tree("sequoia:64,8") == spec.Sequoia(64, 8)
  assert spec.parse_tree("dynamic:32,6") == spec.Dynamic(32, 6)
  assert spec.Levels(spec.parse_level("draft"), "3").tree == spec.Chain(3)   # text is parsed, as a Level's name
  assert spec.Chain(4).topology() == tree_lib.chain(4) and spec.Kary(2, 3).topology() == tree_lib.kary(2, 3)
  assert spec.Dynamic(32, 6).topology() == tree_lib.DynamicTree(32, 6)
  assert spec.Sequoia(8, 3).topology([0.6, 0.2]) == tree_lib.from_acceptance([0.6, 0.2], 8, 3)
  with pytest.raises(ValueError, match="a sequoia tree is built from the draft's acceptance profile"):
    spec.Sequoia(8, 3).topology()
  for bad in ("chain", "chain:", "chain:0", "chain:-1", "chain:x", "kary:2", "kary:2x",
              "kary:0x3", "kary:2,3", "sequoia:64", "sequoia:0,8", "dynamic:8x2",
              "tree:4", "", "CHAIN:4", "0"):
    with pytest.raises(ValueError, match="bad tree spec"):
      spec.parse_tree(bad)
  with pytest.raises(ValueError, match="'chain:x'"):
    spec.parse_tree("chain:x")
  with pytest.raises(ValueError, match="budget=21 nodes do not fit in the 20 candidates"):
    spec.parse_tree("dynamic:21,2")  # width 4: 4 + 16 candidates
  # The size is counted, never built (kary:10x10 would be 10^10 nodes).
  with pytest.raises(ValueError, match="asks for 1022 nodes"):
    spec.parse_tree("kary:2x9")
  assert spec.parse_tree("kary:2x8").topology().size == 510
  with pytest.raises(ValueError, match="asks for 600 nodes"):
    spec.parse_tree("dynamic:10,600")
  with pytest.raises(ValueError, match="asks for 11111111110 nodes"):
    spec.Kary(10, 10)
  with pytest.raises(ValueError, match="bad tree spec 'chain:0'"):
    spec.parse("ngram:3/chain:0")


@pytest.mark.parametrize("method", ["sd/ngram/4", "tree/self:8/kary:2x2", "retrieval/6", "triforce/drafts/d.gguf",
                                    "hitree/drafts/d.gguf/kary:3x2", "hsd/ngram:3/chain:2+draft/4+retrieval:512/6"])
def test_every_preset_expands_to_a_spec_that_round_trips(method, monkeypatch):
  monkeypatch.setattr("hitree_jax.loading.resolve", lambda path: path)   # no draft file needed
  levels = methods.parse_method(method, methods.Knobs(draft="drafts/d.gguf")).levels
  assert spec.parse(str(levels)) == levels and str(spec.parse(str(levels))) == str(levels)


@pytest.mark.parametrize("text, error", [
    ("ngram", "expected DRAFTER/TREE"),
    ("ngram:3@streaming:4x8/chain:2", "ngram:3 keeps no cache of its own"),
    ("d@streaming:4/chain:2", "expected full or streaming:SINKSxWINDOW"),
    ("d/chain:2+retrieval:big/6", "expected retrieval:BUDGET"),
    ("d/chain:2+retrieval:512/six", "expected retrieval:BUDGET/GAMMA"),
    ("d/chain:2+retrieval:512,iid/6", "a middle level hands up its own samples"),
    ("d/chain:2+self:4/3", "only proposes"),
])
def test_bad_pieces_are_named(text, error):
  with pytest.raises(ValueError, match=re.escape(error)):
    spec.parse(text)


def test_a_preset_from_python_is_the_stack_built_by_hand():
  """methods.method: the presets by name in the library, options as keywords, one Stack each."""
  draft = "drafts/smollm2-draft.gguf"
  target, draft_config, vocab = load_config("smollm2"), load_config(draft), load_vocab(draft)
  triforce = methods.method("triforce", draft=draft, budget=512)
  assert str(triforce.levels) == f"{draft}@streaming:16x234/chain:1+retrieval:512/6"
  by_hand = Stack(ModelDrafter(draft_config, target_vocab_size=vocab.target_vocab_size, cache=Streaming(16, 234)),
                  tree_lib.chain(1), (Verifier("target", Retrieval(512), 6),), draft=draft_config)
  assert triforce.build(target, draft_config, vocab) == by_hand
  hitree = methods.method(f"hitree/{draft}/kary:3x2", gamma2=8).build(target, draft_config, vocab)
  assert hitree.tree == tree_lib.kary(3, 2) and hitree.verifiers[0].gamma == 8
  assert methods.method("ar").build(target) == Stack()


@pytest.mark.parametrize("call, error", [
    (lambda: methods.method("sd", budget=512), "budget does not apply to method 'sd' (it reads draft, gamma, step_aside)"),
    (lambda: methods.method("sd", gama=3), "unknown option(s) gama"),
    (lambda: methods.method("speculate"), "method 'speculate' is not available"),
])
def test_a_bad_preset_or_option_is_named(call, error):
  with pytest.raises(ValueError, match=re.escape(error)):
    call()


def test_stacks_build_each_kind_from_its_spec():
  """hitree_jax/stacks.py, the one builder: every kind of level from its spec (text or parsed),
  equal to the Stack written by hand; what a spec cannot build is named."""
  from hitree_jax import stacks
  from hitree_jax.decode.drafters import NGramDrafter, SelfDrafter
  target, draft = load_config("smollm2"), load_config("drafts/smollm2-draft.gguf")
  vocab = load_vocab("drafts/smollm2-draft.gguf")
  assert stacks.build("ngram:2-4/chain:3", target) == Stack(NGramDrafter(4, min_ngram=2), tree_lib.chain(3))
  assert stacks.build(spec.parse("self:4,iid/kary:2x2"), target) == Stack(SelfDrafter(4, "iid"), tree_lib.kary(2, 2))
  assert stacks.build("retrieval:512,iid/4", target) == Stack(
      ModelDrafter(target, "iid", cache=Retrieval(512), weights="target"), tree_lib.chain(4))
  hierarchy = stacks.build("ngram:3/chain:2+draft@streaming:16x234/3+retrieval:256:64/6", target, draft, vocab)
  assert hierarchy == Stack(NGramDrafter(3), tree_lib.chain(2),
                            (Verifier("draft", Streaming(16, 234), 3), Verifier("target", Retrieval(256, reselect=64), 6)),
                            draft=draft)
  with pytest.raises(ValueError, match="names a draft model: give its path"):
    stacks.build("draft/chain:2", target)
  with pytest.raises(ValueError, match="prompt lookup proposes what it found; it draws nothing"):
    stacks.build("ngram:3,iid/chain:2", target)
  with pytest.raises(ValueError, match="a sequoia tree is built from the draft's acceptance profile"):
    stacks.build("draft/sequoia:8,4", target, draft, vocab)
  with pytest.raises(ValueError, match="layers=30"):   # checked against the target, from configs
    stacks.build("self:30/chain:2", target)
