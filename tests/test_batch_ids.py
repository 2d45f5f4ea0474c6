"""Out-of-range ids and targets never train silently.

The host check (`check_batch`) names the entry, the value and the row; inside jit an
out-of-range id or weighted target turns the loss into NaN instead of being wrapped to
another id, and padding (weight 0) may hold anything.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.layers.embeddings import Embed
from tfm.models import DecoderLM, EncoderDecoder, EncoderModel
from tfm.models.presets import tiny
from tfm.train.batch_checks import check_batch
from tfm.train.tasks import LMTask, MLMTask, Seq2SeqTask

V, B, T, P = 64, 8, 8, 3  # B = the 8 simulated devices, so the trainer can take these batches
LAYOUTS = {"lm": ("decoder", DecoderLM, LMTask), "mlm": ("encoder", EncoderModel, MLMTask),
           "seq2seq": ("encdec", EncoderDecoder, Seq2SeqTask)}


def good_batch(layout: str) -> dict:
    rng = np.random.default_rng(0)
    ids = lambda *shape: rng.integers(0, V, shape).astype(np.int32)
    weights = np.ones((B, T), np.int32)
    weights[:, -2:] = 0  # padding
    if layout == "lm":
        return {"inputs": ids(B, T), "targets": ids(B, T), "weights": weights}
    if layout == "seq2seq":
        return {"inputs": ids(B, T), "targets_in": ids(B, T), "targets": ids(B, T), "weights": weights}
    return {"input_ids": ids(B, T), "token_type_ids": np.zeros((B, T), np.int32),
            "attention_mask": np.ones((B, T), np.int32), "mlm_positions": np.tile(np.arange(P, dtype=np.int32), (B, 1)),
            "mlm_ids": ids(B, P), "mlm_weights": np.asarray([[1, 1, 0]] * B, np.int32),
            "nsp_label": np.arange(B, dtype=np.int32) % 2}


def with_value(batch: dict, key: str, value: int, row: int = 1) -> dict:
    bad = {k: v.copy() for k, v in batch.items()}
    bad[key][(row, 0) if bad[key].ndim == 2 else row] = value
    return bad


# (layout, entry, too large): each entry checked at -1 and at its bound.
CASES = [("lm", "inputs", V), ("lm", "targets", V), ("seq2seq", "inputs", V),
         ("seq2seq", "targets_in", V), ("seq2seq", "targets", V), ("mlm", "input_ids", V),
         ("mlm", "mlm_ids", V), ("mlm", "nsp_label", 2), ("mlm", "token_type_ids", 2),
         ("mlm", "mlm_positions", T)]
BAD = [(layout, key, value) for layout, key, bound in CASES for value in (-1, bound, bound + 6)]


def task_and_config(layout: str, vocab_chunk=None):
    family, model_cls, task_cls = LAYOUTS[layout]
    config = tiny(family)
    return model_cls(config), task_cls(vocab_chunk=vocab_chunk), config


@pytest.mark.parametrize("layout, key, value", BAD)
def test_host_check_names_entry_value_and_row(layout, key, value):
    _, task, config = task_and_config(layout)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] has id {value} outside \[0, \d+\).* at row 1"):
        check_batch(task, with_value(good_batch(layout), key, value), config)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_host_check_passes_good_batches_and_any_padding_target(layout):
    _, task, config = task_and_config(layout)
    batch = good_batch(layout)
    check_batch(task, batch, config)
    target, weights = ("mlm_ids", "mlm_weights") if layout == "mlm" else ("targets", "weights")
    batch[target][batch[weights] == 0] = -100  # an ignore-index convention in padding
    check_batch(task, batch, config)


def loss_under_jit(model, task, example_batch):
    """batch -> the task's loss under jit, with parameters initialised from `example_batch`."""
    params = task.init_variables(model, jax.random.PRNGKey(0), example_batch)["params"]

    @jax.jit
    def loss(batch):
        return task.loss(model, params, batch, jax.random.PRNGKey(1), task.weight_totals(batch),
                         deterministic=True)[1]["loss"]
    return loss


@functools.lru_cache(maxsize=None)
def jitted_loss(layout: str, vocab_chunk):
    model, task, _ = task_and_config(layout, vocab_chunk)
    return loss_under_jit(model, task, good_batch(layout))


@pytest.mark.parametrize("vocab_chunk", [None, 16])
@pytest.mark.parametrize("layout, key, value", BAD)
def test_out_of_range_under_jit_gives_nan_not_a_wrapped_id(layout, key, value, vocab_chunk):
    loss = jitted_loss(layout, vocab_chunk)
    assert np.isfinite(loss(good_batch(layout)))
    assert np.isnan(loss(with_value(good_batch(layout), key, value)))


@pytest.mark.parametrize("vocab_chunk", [None, 16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("value", [-100, V, 10 * V])
def test_padding_targets_may_hold_anything_under_jit(layout, value, vocab_chunk):
    loss = jitted_loss(layout, vocab_chunk)
    batch = good_batch(layout)
    target, weights = ("mlm_ids", "mlm_weights") if layout == "mlm" else ("targets", "weights")
    padded = {k: v.copy() for k, v in batch.items()}
    padded[target][batch[weights] == 0] = value
    np.testing.assert_allclose(loss(padded), loss(batch), rtol=1e-6)


def test_negative_ids_embed_as_nan_under_jit_not_as_the_last_row():
    embed = Embed(V, 4)
    params = embed.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    out = jax.jit(embed.apply)(params, jnp.asarray([[-1, V, V - 1]]))
    assert np.isnan(out[0, 0]).all() and np.isnan(out[0, 1]).all()
    assert np.isfinite(out[0, 2]).all()


@pytest.mark.parametrize("layout, key, value", BAD)
def test_the_trainer_refuses_out_of_range_ids_where_data_enters(layout, key, value):
    from tfm.train import TrainConfig, Trainer
    model, task, _ = task_and_config(layout)
    trainer = Trainer(model, task, TrainConfig(batch_size=8)).setup(good_batch(layout))
    trainer.global_batch(good_batch(layout))
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] has id {value} outside"):
        trainer.global_batch(with_value(good_batch(layout), key, value))


# Explicit positions of packed rows index a learned table [max_len, D] at every token.
POSITIONS = [("lm", "positions"), ("seq2seq", "inputs_positions"), ("seq2seq", "targets_positions")]


def learned_positions_case(layout: str):
    """(model, task, config with learned positions, max_len 16, and a packed batch: two
    examples a row, positions restarting at each)."""
    family, model_cls, task_cls = LAYOUTS[layout]
    config = dataclasses.replace(tiny(family), position="learned", max_len=16)
    batch = good_batch(layout)
    segments = np.tile(np.asarray([1, 1, 1, 2, 2, 2, 0, 0], np.int32), (B, 1))
    positions = np.tile(np.asarray([0, 1, 2, 0, 1, 2, 0, 0], np.int32), (B, 1))
    sides = ("",) if layout == "lm" else ("inputs_", "targets_")
    for side in sides:
        batch[f"{side}segment_ids"], batch[f"{side}positions"] = segments.copy(), positions.copy()
    return model_cls(config), task_cls(), config, batch


@pytest.mark.parametrize("value", [-1, 16, 40])
@pytest.mark.parametrize("layout, key", POSITIONS)
def test_learned_positions_outside_the_table_are_refused_and_nan_under_jit(layout, key, value):
    model, task, config, batch = learned_positions_case(layout)
    check_batch(task, batch, config)
    bad = with_value(batch, key, value)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] has id {value} outside \[0, 16\).* at row 1"):
        check_batch(task, bad, config)
    loss = loss_under_jit(model, task, batch)
    assert np.isfinite(loss(batch))
    assert np.isnan(loss(bad))  # -1 no longer reads the table's last row


def test_positions_of_other_kinds_are_not_table_rows():
    """Sinusoidal positions have no table: a position past max_len is a valid angle."""
    _, task, config, batch = learned_positions_case("seq2seq")
    config = dataclasses.replace(config, position="sinusoidal")
    check_batch(task, with_value(batch, "inputs_positions", 40), config)
