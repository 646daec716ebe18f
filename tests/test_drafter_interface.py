"""A drafter written outside the library, against decode.drafters.Drafter alone: the engine runs
it in a flat stack and under a retrieval level with greedy output equal to `ar`'s, and refuses
what its `check` refuses. The engine never asks a drafter's type (no isinstance on drafters)."""

import ast
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.decode import engine
from hitree_jax.decode.drafters import Drafter, Proposal, tree_attend_mask
from hitree_jax.cache.kinds import Retrieval
from hitree_jax.decode.stack import Stack, Verifier
from hitree_jax.tree import shapes as tree_lib
from hitree_jax.tree.shapes import DynamicTree
from tests.helpers import REPO, peaked, tiny_target

CONFIG = tiny_target()
PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 3, 5, 7, 2, 9, 4, 6, 1, 8, 3, 5, 7, 11], [2, 4], [8, 1, 9, 30, 2]]


@dataclasses.dataclass(frozen=True)
class LookupDrafter(Drafter):
  """Follows a fixed next-token table from the root: no cache, no weights, a chain."""
  table: tuple[int, ...]

  def __str__(self) -> str:
    return "lookup"

  def check(self, tree, config) -> None:
    if isinstance(tree, DynamicTree) or tree.size != tree.max_depth:
      raise ValueError("the lookup drafter proposes a chain")
    if len(self.table) != config.vocab_size:
      raise ValueError(f"a table of {len(self.table)} tokens for a vocabulary of {config.vocab_size}")

  def propose(self, key, tree, inp) -> Proposal:
    del key
    table = jnp.asarray(self.table, jnp.int32)
    token = inp.seq[jnp.arange(inp.seq.shape[0]), inp.end - 1]   # [B] the root
    chain = []
    for _ in range(tree.size):
      token = table[token]
      chain.append(token)
    return Proposal(tokens=jnp.stack(chain, axis=1), q=None, start=inp.end,
                    depth=jnp.asarray(tree.depth), attend=jnp.asarray(tree_attend_mask(tree)))


@pytest.fixture(scope="module")
def params():
  return peaked(CONFIG, 0)


@pytest.fixture(scope="module")
def ar_tokens(params):
  return engine.generate(params, CONFIG, PROMPTS, max_new_tokens=30).tokens


def table_from(rows) -> tuple[int, ...]:
  """The token that followed each token somewhere in rows (0 where none did): often right."""
  table = np.zeros(CONFIG.vocab_size, np.int64)
  for row in rows:
    for a, b in zip(row, row[1:]):
      table[a] = b
  return tuple(int(t) for t in table)


@pytest.mark.parametrize("verifiers", [(), pytest.param((Verifier("target", Retrieval(16, 4), 4),), marks=pytest.mark.slow)],
                         ids=["flat", "retrieval"])
def test_a_drafter_from_outside_is_exact_and_accepted(params, ar_tokens, verifiers):
  drafter = LookupDrafter(table_from([p + t for p, t in zip(PROMPTS, ar_tokens)]))
  stack = Stack(drafter, tree_lib.chain(3), verifiers)
  result = engine.generate(params, CONFIG, PROMPTS, stack=stack, max_new_tokens=30)
  assert result.tokens == ar_tokens
  bottom = result.levels[0]
  assert bottom["accepted"] > 0 and bottom["accepted"] < bottom["proposed"]  # it proposed, some held


def test_its_check_is_the_engines(params):
  drafter = LookupDrafter((0,) * 7)
  with pytest.raises(ValueError, match="a table of 7 tokens for a vocabulary of 53"):
    engine.generate(params, CONFIG, PROMPTS, stack=Stack(drafter, tree_lib.chain(3)), max_new_tokens=4)
  with pytest.raises(ValueError, match="proposes a chain"):
    engine.generate(params, CONFIG, PROMPTS, stack=Stack(drafter, tree_lib.kary(2, 2)), max_new_tokens=4)


def test_the_engine_never_asks_a_drafters_type():
  """No isinstance/getattr on a drafter class in decode/ outside drafters.py itself, and decode/
  imports nothing from heads/ (heads/ implements the interface; decode/ does not know it)."""
  names = {"NGramDrafter", "SelfDrafter", "ModelDrafter", "EagleDrafter", "MedusaDrafter"}
  for path in (REPO / "hitree_jax" / "decode").glob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        assert not node.module.startswith("hitree_jax.heads"), f"{path.name} imports {node.module}"
      if path.name != "drafters.py" and isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
        assert not names & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}, path.name


def test_a_drafter_that_reads_the_level_above_refuses_a_draft_models_level():
  """Self-drafts read the level above's cache, EAGLE and Medusa its features: all three need the
  target's weights there (engine.check_stack asks check_above); the others read nothing above."""
  from hitree_jax.decode.drafters import ModelDrafter, NGramDrafter, SelfDrafter
  from hitree_jax.heads.drafter import EagleDrafter, MedusaDrafter
  reading = {SelfDrafter(1): "cache", EagleDrafter(CONFIG): "features", MedusaDrafter(2, 64): "features"}
  for drafter, what in reading.items():
    drafter.check_above("target")
    with pytest.raises(ValueError, match=f"the {drafter} drafter reads the {what} of the level above it"):
      drafter.check_above("draft")
  for drafter in (NGramDrafter(), ModelDrafter(CONFIG)):
    drafter.check_above("draft")
