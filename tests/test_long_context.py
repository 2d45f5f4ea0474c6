"""The long-context experiment (experiments/long_context): its needle documents checked by brute
force, the sliding window's receptive field (the claim the experiment rests on) checked by exact
zero gradients, every attention variant built from its config and trained one step, and the
variants' config values found in the parameters they create."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from experiments import common
from experiments.long_context import compare, documents, train
from experiments.long_context.configs import tiny
from experiments.long_context.settings import LongContextSettings
from tfm.models import EncoderModel
from tfm.kernels import sparsity
from tfm.train import ClassificationTask, OptimizerConfig, TrainState, make_optimizer, make_train_step

L = 128  # the recipe's variants at a quarter of its length: window 32 still reaches 62 < L - 1


def _config(variant, **keys):
    c = tiny.get_config(variant)
    c.length = L
    c.model.overrides.max_len = L
    for key, value in keys.items():
        setattr(c, key, value)
    return c


def _model_config(variant):
    return compare.model_config(_config(variant))


def _params(cfg):
    model = EncoderModel(cfg)
    return nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.zeros((1, L), jnp.int32))["params"])


def test_documents_are_pure_and_their_label_is_their_one_needle():
    a, b = documents.make(0, "train", 5, L), documents.make(0, "train", 5, L)
    assert np.array_equal(a.tokens, b.tokens) and (a.label, a.needle) == (b.label, b.needle)
    assert not np.array_equal(a.tokens, documents.make(0, "test", 5, L).tokens)
    assert not np.array_equal(a.tokens, documents.make(1, "train", 5, L).tokens)
    labels, needles = [], []
    for i in range(400):
        d = documents.make(3, "test", i, L)
        found = [p for p, t in enumerate(d.tokens) if t in documents.NEEDLES]  # brute force: scan the document
        assert found == [d.needle] and d.label == documents.NEEDLES.index(d.tokens[d.needle])
        assert d.tokens[0] == documents.CLS and d.tokens.shape == (L,) and d.tokens.dtype == np.int32
        rest = np.delete(d.tokens, [0, d.needle])
        assert rest.min() >= documents.FILLER.start and rest.max() < documents.FILLER.stop <= documents.VOCAB_SIZE
        labels.append(d.label), needles.append(d.needle)
    assert 0.4 < np.mean(labels) < 0.6
    assert min(needles) <= 5 and max(needles) >= L - 6  # needles anywhere in 1 .. L - 1
    b = documents.batch(3, "test", [7, 8], L)
    assert np.array_equal(b["input_ids"][1], documents.make(3, "test", 8, L).tokens)
    assert b["label"].tolist() == [documents.make(3, "test", i, L).label for i in (7, 8)]


def test_variant_config_values_reach_the_model():
    full = _model_config("full")
    shapes = {}  # each variant's parameter shapes, traced once

    def flat(cfg):
        if cfg not in shapes:
            shapes[cfg] = traverse_util.flatten_dict(jax.eval_shape(lambda: _params(cfg)), sep="/")
        return shapes[cfg]
    count = lambda cfg: sum(x.size for x in flat(cfg).values())
    D, KH, n = full.d_model, full.num_heads * full.head_dim, full.num_layers

    lin = _model_config("linformer")
    projections = {k: v.shape for k, v in flat(lin).items() if k.endswith("length_projection")}
    assert projections == {f"encoder/layer_{i}/self_attn/length_projection": (L, 64) for i in range(n)}
    assert count(lin) == count(full) + n * L * 64

    vr = _model_config("value_rank")
    r = vr.value_rank
    assert r == 8 and flat(vr)["encoder/layer_0/self_attn/value_down/kernel"].shape == (D, r)
    assert count(vr) == count(full) - n * D * KH + n * (D * r + r * KH)  # W_V [D, KH] -> [D, r] [r, KH]

    assert _model_config("window").sliding_window == tiny.WINDOW
    assert _model_config("longformer").attention_sparsity == sparsity.Longformer(tiny.WINDOW, globals=1)
    assert _model_config("bigbird").attention_sparsity == sparsity.BigBird(tiny.WINDOW, window=1, globals=1, random=1)
    assert _model_config("strided").attention_sparsity == sparsity.Strided(tiny.WINDOW)
    for v in ("window", "longformer", "bigbird", "strided"):
        assert count(_model_config(v)) == count(full), v  # masks cost no parameters

    assert tiny.get_config("window,runlocal").to_dict() == tiny.get_config("window").to_dict()
    with pytest.raises(ValueError, match="variant 'windw' unknown"):
        tiny.get_config("windw")
    with pytest.raises(ValueError, match="config.length=1024 exceeds model.overrides.max_len=128"):
        train.check_settings(common.settings_of(_config("full", length=1024), LongContextSettings),
                             full)


@pytest.mark.parametrize("variant", sorted(tiny.VARIANTS))
def test_every_variant_trains_one_step_and_only_the_window_keeps_cls_from_far_tokens(variant):
    """One AdamW step without weight decay moves a parameter iff its gradient is non-zero. Row p of
    the position table is added to position p's input only, so it moves iff position p reaches the
    CLS state: never beyond reach = n (w - 1) for the window, everywhere for the others (a global
    CLS row, global blocks, strided columns, a length projection, or full attention)."""
    reach = documents.reach(tiny.LAYERS, tiny.WINDOW)
    assert reach == 2 * 31 == tiny.get_config().near
    optimizer = OptimizerConfig(name="adamw", learning_rate=1e-3, weight_decay=0.0)
    tx, schedule = make_optimizer(optimizer, num_train_steps=1)
    model, batch = EncoderModel(_model_config(variant)), documents.batch(0, "train", range(4), L)
    before = _params(model.config)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=before, opt_state=tx.init(before),
                       rng=jax.random.PRNGKey(0))
    state, metrics = jax.jit(make_train_step(model, ClassificationTask(), tx, schedule))(state, batch)
    after = jax.device_get(state.params)
    assert np.isfinite(float(metrics["loss"])) and 0.3 < float(metrics["loss"]) < 2.0  # about log 2 at init
    rows_moved = np.any(before["input"]["position"]["embedding"] != after["input"]["position"]["embedding"], -1)
    if variant == "window":
        assert not rows_moved[reach + 1:].any(), np.nonzero(rows_moved[reach + 1:])
        assert rows_moved[:reach + 1].all()  # the reach is tight: the farthest visible token counts
    else:
        assert rows_moved.all(), np.nonzero(~rows_moved)
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after)
    assert all(jax.tree.leaves(moved)), moved


def test_held_out_scores_split_at_the_window_reach():
    c = _config("full", eval_documents=24)
    s = common.settings_of(c, LongContextSettings)
    cfg = _model_config("full")
    scores = train.held_out_scores(EncoderModel(cfg), _params(cfg), s, seed=0, batch_size=8)
    needles = np.array([documents.make(0, "test", i, L).needle for i in range(24)])
    assert scores["near_documents"] == int((needles <= 62).sum()) and scores["far_documents"] == int((needles > 62).sum())
    assert 0 < scores["near_documents"] < 24
    overall = (scores["near_accuracy"] * scores["near_documents"] + scores["far_accuracy"] * scores["far_documents"]) / 24
    assert scores["accuracy"] == pytest.approx(overall, abs=1e-9) and scores["chance"] == 0.5
