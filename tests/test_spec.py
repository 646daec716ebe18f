"""The --levels grammar as types (decode/spec.py): docs/methods.md's examples parse and print
back as written, the presets expand to specs that round-trip, and bad pieces are named."""

import pathlib
import re

import pytest

from hitree_jax.decode import spec
from hitree_jax.decode.stack import Full, Retrieval, Streaming
from launch import common

DOCS = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "methods.md").read_text()


def documented_specs() -> list[str]:
  """Every concrete --levels spec in docs/methods.md: `--levels=...` and the backticked
  examples written in the grammar (placeholders in capitals left out)."""
  found = re.findall(r"--levels=(\S+)", DOCS) + re.findall(r"`([^`\s]+/[^`\s]+)`", DOCS)
  return sorted({s for s in found if not re.search(r"[A-Z]{2,}|^sd/|\[", s)})


def test_every_documented_spec_round_trips():
  specs = documented_specs()
  assert len(specs) >= 4 and "ngram:3/chain:2+draft/3+retrieval:1024/6" in specs
  for text in specs:
    assert str(spec.parse(text)) == text


def test_a_spec_is_typed():
  triforce = spec.parse("drafts/d.gguf@streaming:16x234:reindex,iid/chain:1+retrieval:1024:64/6")
  assert triforce.drafter == spec.Level("drafts/d.gguf", Streaming(16, 234, reindex=True), "iid")
  assert triforce.drafter.kind == "draft" and triforce.tree == "chain:1"
  (middle, gamma), = triforce.middles
  assert (middle.kind, middle.retrieval, middle.budget, gamma) == ("retrieval", Retrieval(1024, reselect=64), 1024, 6)
  assert spec.parse_level("eagle:drafts/e").feature_draft == ("eagle", "drafts/e")
  assert spec.parse_level("draft@full").cache == Full() and spec.parse_level("ngram").kind == "ngram"
  # the cache kind prints as the grammar writes it
  assert str(Streaming(16, 234)) == "streaming:16x234"


@pytest.mark.parametrize("method", ["sd/ngram/4", "tree/self:8/kary:2x2", "retrieval/6", "triforce/drafts/d.gguf",
                                    "hitree/drafts/d.gguf/kary:3x2", "hsd/ngram:3/chain:2+draft/4+retrieval:512/6"])
def test_every_preset_expands_to_a_spec_that_round_trips(method, monkeypatch):
  monkeypatch.setattr("hitree_jax.loading.resolve", lambda path: path)   # no draft file needed
  levels = common.parse_method(method, common.Knobs(draft="drafts/d.gguf")).levels
  assert str(spec.parse(levels)) == levels


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
