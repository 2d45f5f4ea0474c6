"""Initialising a model from a checkpoint (tfm.train.init_from): a tiny encoder's saved params
restored into the same encoder with an extra head, read through the Checkpointer."""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from tfm.models import EncoderModel
from tfm.models.presets import tiny
from tfm.train import Checkpointer, CheckpointError, OptimizerConfig, TrainState
from tfm.train.checkpoint import CorruptCheckpointError
from tfm.train.init_from import checkpoint_params, merge_params
from tfm.train.optim import make_optimizer

IDS = jnp.zeros((1, 8), jnp.int32)


def _params(cfg, seed):
    return nn.unbox(EncoderModel(cfg).init(jax.random.PRNGKey(seed), IDS)["params"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """checkpoints/{3,5} of a pretraining-like run (params and Adam state): step 5's params are
    step 3's plus one."""
    directory = str(tmp_path_factory.mktemp("init_from") / "checkpoints")
    params = _params(tiny("encoder", heads=("mlm",)), seed=1)
    tx, _ = make_optimizer(OptimizerConfig(), 10)
    ckpt = Checkpointer(directory, every=1, async_save=False)
    for step, shift in ((3, 0.0), (5, 1.0)):
        p = jax.tree.map(lambda x: x + shift, params)
        ckpt.save(step, TrainState(step=jnp.int32(step), params=p, opt_state=tx.init(p),
                                   rng=jnp.zeros(2, jnp.uint32)), force=True)
    ckpt.close()
    return directory, params


def _flat(tree):
    return traverse_util.flatten_dict(tree, sep="/")


def test_newest_params_go_into_a_model_with_an_extra_head(saved):
    directory, params = saved
    loaded, step = checkpoint_params(directory)
    assert step == 5 and sorted(os.listdir(directory)) == ["3", "5"]  # read-only: nothing written
    want = _flat(jax.tree.map(lambda x: np.asarray(x + 1.0), params))
    assert _flat(loaded).keys() == want.keys()
    assert all(isinstance(v, np.ndarray) and v.dtype == want[k].dtype and np.array_equal(v, want[k])
               for k, v in _flat(loaded).items())

    fresh = _params(tiny("encoder", heads=("mlm", "classification")), seed=2)
    merged = _flat(merge_params(fresh, loaded, source="test checkpoint"))
    new = {k for k in _flat(fresh) if k not in want}
    assert new and all(k.startswith(("classifier/", "pooler/")) for k in new), new
    for k, v in merged.items():
        expected = want[k] if k in want else np.asarray(_flat(fresh)[k])
        assert np.asarray(v).dtype == expected.dtype and np.array_equal(np.asarray(v), expected), k
        if k in new and k.endswith("kernel"):  # the new head keeps its (random) init
            assert np.asarray(v).any(), k


def test_an_older_step_and_jax_array_targets_keep_dtype_and_sharding(saved):
    directory, params = saved
    loaded, step = checkpoint_params(directory, step=3)
    assert step == 3
    fresh = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.bfloat16), params)
    merged = merge_params(fresh, loaded, source="x")
    for got, f, want in zip(jax.tree.leaves(merged), jax.tree.leaves(fresh), jax.tree.leaves(params)):
        assert isinstance(got, jax.Array) and got.dtype == jnp.bfloat16 and got.sharding == f.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))


def test_mismatches_are_one_clear_line(saved, tmp_path):
    directory, _ = saved
    loaded, _ = checkpoint_params(directory)
    wide = _params(tiny("encoder", heads=("mlm",), d_model=48), seed=0)
    with pytest.raises(ValueError, match=r"^ckpt 5: param \S+ has shape \(\d+(, \d+)*\), the model \(\d+(, \d+)*\)$"):
        merge_params(wide, loaded, source="ckpt 5")
    headless = _params(tiny("encoder", heads=()), seed=0)
    with pytest.raises(ValueError, match=r"^ckpt 5: param mlm_\S+ has no place in the model$"):
        merge_params(headless, loaded, source="ckpt 5")
    extra = tuple(sorted(set(loaded) - set(headless)))  # the MLM head's modules
    assert extra and all(k.startswith("mlm") for k in extra), extra
    merged = merge_params(headless, loaded, source="ckpt 5", optional=extra)  # dropped: the model has none
    assert set(merged) == set(headless)
    assert np.array_equal(merged["embed"]["embedding"], loaded["embed"]["embedding"])

    with pytest.raises(CheckpointError, match=r"holds no checkpoint$"):
        checkpoint_params(str(tmp_path / "empty"))
    assert not (tmp_path / "empty").exists()
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 4 .*available: \[3, 5\]"):
        checkpoint_params(directory, step=4)


def test_a_corrupt_checkpoint_is_one_line(saved, tmp_path):
    import shutil
    directory = str(tmp_path / "checkpoints")
    shutil.copytree(saved[0], directory)
    for root, _, files in os.walk(os.path.join(directory, "5", "state")):
        for f in files:
            if not f.startswith("_"):
                open(os.path.join(root, f), "wb").close()  # truncate the array data
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint \S+/5 (could not be restored|is unreadable) "
                                                     r"\(corrupt or partial\): ") as e:
        checkpoint_params(directory)
    assert "\n" not in str(e.value)
    assert checkpoint_params(directory, step=3)[1] == 3
