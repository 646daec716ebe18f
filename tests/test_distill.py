"""Distillation on a tiny teacher/student: loss falls, resume is exact, metrics match brute force."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hitree_jax.decode.sampling import SamplingParams, probabilities
from hitree_jax.model.vocab import OTHER, ReducedVocab
from hitree_jax.train import distill, metrics, teacher
from tests.helpers import TEACHER  # its params and data: conftest's teacher_params and distill_data


def student_data(distill_data):
  windows, ids, log_probs, vocab = distill_data
  return (vocab.to_draft(windows), *distill.sparse_targets(ids, log_probs, vocab))


def test_teacher_topk_is_the_top_of_the_full_distribution(teacher_params, distill_data):
  windows, ids, log_probs, _ = distill_data
  full = jax.nn.log_softmax(teacher.full_sequence_logits(teacher_params, TEACHER,
                                                         jnp.asarray(windows[:2])), axis=-1)
  np.testing.assert_allclose(log_probs[:2, :, 0], np.asarray(full).max(-1), atol=1e-5)
  np.testing.assert_array_equal(ids[:2, :, 0], np.asarray(full).argmax(-1))
  assert np.all(np.diff(log_probs, axis=-1) <= 0)


def test_labelling_resumes_from_the_saved_chunks(tmp_path, teacher_params, distill_data):
  windows, ids, log_probs, _ = distill_data
  path = tmp_path / "labels.npz"
  labels = distill.label_windows(path, windows, teacher_params, TEACHER, k=8, chunk=16)
  np.testing.assert_array_equal(labels["ids"], ids)
  np.testing.assert_allclose(labels["log_probs"], log_probs, atol=1e-2)  # stored as float16
  assert path.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["labels.npz"]

  # An interrupted run left chunk 1 on disk: the rerun takes it as it is and labels the rest.
  marked = labels["ids"][16:32] + 1
  np.savez(tmp_path / "labels.part00001.npz", ids=marked, log_probs=labels["log_probs"][16:32])
  path.unlink()
  resumed = distill.label_windows(path, windows, teacher_params, TEACHER, k=8, chunk=16)
  np.testing.assert_array_equal(resumed["ids"][16:32], marked)
  np.testing.assert_array_equal(np.delete(resumed["ids"], np.s_[16:32], 0),
                                np.delete(ids, np.s_[16:32], 0))
  with np.load(path) as saved:
    np.testing.assert_array_equal(saved["ids"], resumed["ids"])


def test_a_token_draft_reuses_a_feature_drafts_labels(tmp_path, teacher_params, distill_data):
  """Labels made with the teacher's features hold a token draft's: prepare_labels without
  features takes them, features dropped, and asks nothing of the teacher (None here); without
  them it would label again."""
  windows, ids, log_probs, _ = distill_data
  features = np.ones((*windows.shape, 32), np.float16)
  np.savez(tmp_path / f"labels_train_{len(windows)}x{windows.shape[1]}_top8_features.npz",
           tokens=windows, ids=ids, log_probs=log_probs, features=features)
  labels = distill.prepare_labels(tmp_path, "train", None, None, window=windows.shape[1],
                                  n_windows=len(windows), k=8)
  assert sorted(labels) == ["ids", "log_probs", "tokens"]
  np.testing.assert_array_equal(labels["ids"], ids)
  with pytest.raises(AttributeError):   # other labels than those saved: the teacher is asked
    distill.prepare_labels(tmp_path, "train", None, None, window=windows.shape[1], n_windows=len(windows), k=4)


def test_the_teachers_own_text_is_written_once_for_every_kind_of_labels(tmp_path, monkeypatch, teacher_params,
                                                                      distill_data):
  """The teacher's answers depend on the windows and the sampling, not on what is labelled on
  them: a DFlash draft's labels (its taps) after an EAGLE draft's (other taps, another top-k) in
  the same workdir read the answers already written, and so does a file an earlier version named
  after one kind's labels."""
  import types
  windows = distill_data[0][:6]
  written = []
  def own_continuations(params, config, windows, prompt_tokens, sampling, progress=None):
    written.append(len(windows))
    return (windows + 1) % TEACHER.vocab_size
  monkeypatch.setattr(distill.corpus, "token_windows", lambda tokenizer, split, window, n: windows)
  monkeypatch.setattr(teacher, "own_continuations", own_continuations)
  model = types.SimpleNamespace(params=teacher_params, config=TEACHER)
  shape = dict(window=windows.shape[1], n_windows=len(windows), own_text=(8, SamplingParams.create(0.6, 0.9)),
               features=True, teacher_key="aaaa")
  first = distill.prepare_labels(tmp_path, "train", model, None, k=8, taps=(0,), **shape)
  second = distill.prepare_labels(tmp_path, "train", model, None, k=4, taps=(0, 1), **shape)
  assert written == [6]
  np.testing.assert_array_equal(first["tokens"], (windows + 1) % TEACHER.vocab_size)
  np.testing.assert_array_equal(second["tokens"], first["tokens"])
  assert second["features"].shape[-1] == 3 * TEACHER.hidden_size
  (text,) = tmp_path.glob("*_text.npy")
  assert text.name == f"labels_aaaa_train_6x{windows.shape[1]}_own8_t0.6_p0.9_text.npy"
  older = tmp_path / "earlier"   # an earlier version's name: beside one kind's labels
  older.mkdir()
  np.save(older / f"labels_aaaa_train_6x{windows.shape[1]}_top32_features_taps1_own8_t0.6_p0.9_text.npy",
          np.load(text))
  distill.prepare_labels(older, "train", model, None, k=8, **shape)
  assert written == [6]


def test_another_teachers_labels_are_never_taken(tmp_path, distill_data):
  """Labels are named by what their teacher holds: those of another teacher in the same workdir
  are not read (the teacher is asked: None here), and the same teacher's are."""
  windows, ids, log_probs, _ = distill_data
  np.savez(tmp_path / f"labels_aaaa_train_{len(windows)}x{windows.shape[1]}_top8.npz",
           tokens=windows, ids=ids, log_probs=log_probs)
  shape = dict(window=windows.shape[1], n_windows=len(windows), k=8)
  labels = distill.prepare_labels(tmp_path, "train", None, None, teacher_key="aaaa", **shape)
  np.testing.assert_array_equal(labels["ids"], ids)
  with pytest.raises(AttributeError):
    distill.prepare_labels(tmp_path, "train", None, None, teacher_key="bbbb", **shape)


@pytest.mark.parametrize("kind", ["gguf", "folder"])
def test_an_export_replaces_the_old_draft_whole_or_not_at_all(tmp_path, kind):
  """train/export.py: a draft (a GGUF and its sidecar, or a folder of heads) interrupted at any
  point of its writing leaves the old one as it was and no temporary; once whole, it replaces the
  old one, and its sidecar names its contents, so a sidecar that outlived its draft is refused."""
  from hitree_jax.train import export

  def write(path, text, interrupt=None):
    if kind == "gguf":
      path.write_text(text)
      if interrupt == "between":
        raise KeyboardInterrupt
      export.write_sidecar(path, {"acceptance_profile": [len(text)]})
    else:
      path.mkdir()
      (path / "heads.json").write_text(text)
      if interrupt == "between":
        raise KeyboardInterrupt
      (path / "weights").write_text(text * 2)
    if interrupt == "after":
      raise RuntimeError("evaluation failed")

  out = tmp_path / ("draft.gguf" if kind == "gguf" else "eagle")
  with export.replacing(out) as partial:
    write(partial, "old")
  before = sorted((p.name, p.read_text() if p.is_file() else "") for p in tmp_path.rglob("*"))
  for interrupt in ("between", "after"):
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
      with export.replacing(out) as partial:
        write(partial, "new", interrupt)
    assert sorted((p.name, p.read_text() if p.is_file() else "") for p in tmp_path.rglob("*")) == before
  with export.replacing(out) as partial:
    write(partial, "newer")
  names = sorted(p.name for p in tmp_path.iterdir())
  if kind == "gguf":
    assert names == ["draft.gguf", "draft.json"] and out.read_text() == "newer"
    record = json.loads(export.sidecar(out).read_text())
    assert export.check_sidecar(out, record)["acceptance_profile"] == [5]
    out.write_text("retrained")   # a draft written over by hand, its sidecar left
    with pytest.raises(ValueError, match="draft.json describes another version of .*draft.gguf"):
      export.check_sidecar(out, record)
  else:
    assert names == ["eagle"] and (out / "weights").read_text() == "newernewer"


def test_sparse_targets_drop_tokens_outside_the_subset(distill_data):
  windows, ids, log_probs, vocab = distill_data
  draft_ids, probs = distill.sparse_targets(ids, log_probs, vocab)
  outside = vocab.to_draft(ids) == OTHER
  assert outside.any() and np.all(probs[outside] == 0)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_array_equal(vocab.to_target(draft_ids[~outside]), ids[~outside])


def test_student_with_every_layer_and_token_is_the_teacher(teacher_params):
  vocab = ReducedVocab(np.arange(-1, TEACHER.vocab_size, dtype=np.int32)[[0, *range(2, 41)]],
                       TEACHER.vocab_size)  # every target token 1..39 (token 0 is left out)
  config, params = distill.student_from_teacher(teacher_params, TEACHER, (0, 1, 2), vocab)
  assert config.vocab_size == 40 and config.eos_token_id == int(vocab.draft_ids[2])
  tokens = np.array([[5, 9, 3, 17, 1, 30]], np.int32)
  want = teacher.full_sequence_logits(teacher_params, TEACHER, jnp.asarray(tokens))
  got = distill.draft_logits(params, config, jnp.asarray(vocab.to_draft(tokens)))
  np.testing.assert_allclose(np.asarray(got)[..., 1:], np.asarray(want)[..., 1:], atol=1e-4)
  assert np.all(np.asarray(got)[..., OTHER] == -np.inf)
  with pytest.raises(ValueError, match=r"student layers \(0, 3\)"):
    distill.student_from_teacher(teacher_params, TEACHER, (0, 3), vocab)


def test_training_lowers_the_loss(tmp_path, teacher_params, distill_data):
  vocab = distill_data[3]
  config, params = distill.student_from_teacher(teacher_params, TEACHER, (0,), vocab)
  train = student_data(distill_data)
  before = distill.evaluate_loss(params, distill.draft_objective(config), train, batch=8)[0]
  params, history = distill.train(tmp_path, config, params, train, None, steps=30, batch=8,
                                  lr=1e-2, warmup=3, seed=0, log_every=10)
  after = distill.evaluate_loss(params, distill.draft_objective(config), train, batch=8)[0]
  assert [h["step"] for h in history] == [10, 20, 30]
  probs = train[2]
  entropy = float(np.mean(-np.sum(np.where(probs > 0, probs * np.log(np.maximum(probs, 1e-30)), 0), -1)))
  # KL to the teacher (a one-layer student of a random three-layer teacher levels off near 0.7x)
  assert after - entropy < 0.8 * (before - entropy), (before, after, entropy)


@pytest.mark.slow
def test_interrupted_training_resumes_to_the_same_weights(tmp_path, teacher_params, distill_data):
  config, params = distill.student_from_teacher(teacher_params, TEACHER, (0,), distill_data[3])
  train = student_data(distill_data)
  kwargs = dict(batch=8, lr=1e-2, warmup=2, seed=3, save_every=2, log_every=1)
  straight, _ = distill.train(tmp_path / "a", config, params, train, None, steps=6, **kwargs)
  distill.train(tmp_path / "b", config, params, train, None, steps=6, until=3, **kwargs)
  resumed, history = distill.train(tmp_path / "b", config, params, train, None, steps=6, **kwargs)
  assert [h["step"] for h in history] == [4, 5, 6]  # it went on from the save at step 3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               straight, resumed)
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, resumed)
  assert max(jax.tree.leaves(moved)) > 1e-3  # training changed the weights at all


def test_resuming_a_run_made_with_other_settings_is_refused(tmp_path, teacher_params, distill_data):
  config, params = distill.student_from_teacher(teacher_params, TEACHER, (0,), distill_data[3])
  kwargs = dict(batch=8, lr=1e-2, warmup=2, seed=3, until=0, settings={"train_windows": 16})
  distill.train(tmp_path, config, params, student_data(distill_data), None, steps=8, **kwargs)  # only labels:
  assert not (tmp_path / distill.SETTINGS).exists()                                            # nothing kept
  distill.train(tmp_path, config, params, student_data(distill_data), None, steps=6, **dict(kwargs, until=1))
  distill.train(tmp_path, config, params, student_data(distill_data), None, steps=6, **kwargs)  # resumes
  with pytest.raises(ValueError, match="steps: 6 there, 8 now"):
    distill.train(tmp_path, config, params, student_data(distill_data), None, steps=8, **kwargs)
  with pytest.raises(ValueError, match="train_windows: 16 there, 32 now"):
    distill.train(tmp_path, config, params, student_data(distill_data), None, steps=6,
                  **dict(kwargs, settings={"train_windows": 32}))


def test_batches_depend_only_on_seed_and_step():
  first = [distill.batch_indices(20, 4, s, seed=1) for s in range(10)]
  assert all(np.array_equal(a, distill.batch_indices(20, 4, s, seed=1)) for s, a in enumerate(first))
  assert sorted(np.concatenate(first[:5]).tolist()) == list(range(20))  # an epoch sees each once


# --- metrics against brute force on a tiny vocabulary ---

def test_position_metrics_match_brute_force():
  rng = np.random.default_rng(1)
  target = rng.normal(size=(50, 6)) * 2
  q = rng.dirichlet(np.ones(6) * 0.5, size=50)
  sampling = SamplingParams.create(0.6, 0.9)
  q = np.pad(q, ((0, 0), (0, metrics.PROFILE_RANKS - 6)))  # 8 ranks: two never-drafted tokens
  target = np.pad(target, ((0, 0), (0, metrics.PROFILE_RANKS - 6)), constant_values=-1e9)
  ranked = np.argsort(-q, axis=-1, kind="stable")  # the draft's children, best first
  agree, accept, profile, greedy_profile = metrics.position_metrics(
      jnp.asarray(target, jnp.float32), jnp.asarray(q, jnp.float32), jnp.asarray(ranked), sampling)
  p = np.asarray(probabilities(jnp.asarray(target, jnp.float32), sampling), np.float64)
  for i in range(50):
    # P(accept) when x ~ q is kept with probability min(1, p(x) / q(x)).
    want = sum(q[i, x] * min(1.0, p[i, x] / q[i, x]) for x in range(6) if q[i, x] > 0)
    assert abs(float(accept[i]) - want) < 1e-5
    assert bool(agree[i]) == (int(np.argmax(target[i])) == int(np.argmax(q[i])))
    # Deterministic children x_1, x_2, ... by q: walk verification's rule, rank by rank.
    residual, reach = p[i].copy(), 1.0
    for rank, x in enumerate(ranked[i, :6]):
      accepted = reach * residual[x] / residual.sum() if residual.sum() > 0 else 0.0
      assert abs(float(profile[i, rank]) - accepted) < 1e-5
      reach -= accepted
      residual[x] = 0.0
  # Greedy: the same walk with the target's one-hot p is "is x_r the target's argmax".
  one_hot = np.asarray(probabilities(jnp.asarray(target, jnp.float32), SamplingParams.create(0.0)))
  np.testing.assert_array_equal(np.asarray(greedy_profile),
                                np.take_along_axis(one_hot, ranked, axis=-1) > 0)


@pytest.mark.slow
def test_evaluate_draft_matches_position_by_position_brute_force(teacher_params, distill_data):
  windows, _, _, vocab = distill_data
  config, params = distill.student_from_teacher(teacher_params, TEACHER, (0, 2), vocab)
  model = lambda c, p: type("M", (), {"config": c, "params": p})
  sampling = SamplingParams.create(0.6, 0.9)
  got = metrics.evaluate_draft(model(TEACHER, teacher_params), model(config, params), vocab,
                               windows[:3], sampling, batch=2)
  target_fn = jax.jit(lambda x: teacher.full_sequence_logits(teacher_params, TEACHER, x))
  draft_fn = jax.jit(lambda x: distill.draft_logits(params, config, x))
  agree, accept = [], []
  for w in windows[:3]:
    for t in range(1, len(w) + 1):  # each prefix on its own (zero-padded: one compile)
      prefix = np.zeros((1, len(w)), np.int32)
      prefix[0, :t] = w[:t]
      p_logits = np.asarray(target_fn(jnp.asarray(prefix)))[0, t - 1]
      d_logits = np.asarray(draft_fn(jnp.asarray(vocab.to_draft(prefix))))[0, t - 1]
      p = np.asarray(probabilities(jnp.asarray(p_logits), sampling), np.float64)
      q_draft = np.asarray(probabilities(jnp.asarray(d_logits), sampling), np.float64)
      q = np.zeros(TEACHER.vocab_size)
      for d in range(1, vocab.size):
        q[vocab.target_ids[d]] = q_draft[d]
      agree.append(np.argmax(p_logits) == vocab.target_ids[np.argmax(d_logits)])
      accept.append(sum(min(p[x], q[x]) for x in range(TEACHER.vocab_size)))
  assert got["positions"] == len(agree)
  assert abs(got["greedy_agreement"] - np.mean(agree)) < 1e-9
  assert abs(got["expected_acceptance"] - np.mean(accept)) < 1e-4
  assert len(got["acceptance_profile"]) == metrics.PROFILE_RANKS
  assert sum(got["acceptance_profile"]) <= 1 + 1e-4 and got["acceptance_profile"][0] > 0
  assert 0 < got["expected_acceptance"] < 1
