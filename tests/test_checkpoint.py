"""Checkpoints: restore onto another mesh, averaging, and clear errors for missing, corrupt
and mismatched checkpoints (none of which deletes anything)."""
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import train_job
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.train import Checkpointer, CheckpointError, LMTask, Trainer, average_checkpoints

EXAMPLE = next(train_job.TokenBatches())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ckpt"))
    result = train_job.run(workdir, 4, async_checkpoint=False)
    return workdir, result


def _trainer(mesh, parallelism="data+fsdp", **model_overrides):
    cfg = train_job.config(4, mesh=mesh)
    cfg = type(cfg)(**{**cfg.__dict__, "parallelism": parallelism})
    return Trainer(DecoderLM(tiny("decoder", **model_overrides)), LMTask(), cfg).setup(EXAMPLE)


def _ckpt(workdir):
    return Checkpointer(os.path.join(workdir, "checkpoints"))


def test_restore_onto_a_different_mesh(run):
    workdir, result = run
    trainer = _trainer((("data", 1), ("fsdp", 2), ("tensor", 4)), "fsdp+tensor")
    state, data_state = _ckpt(workdir).restore(trainer.abstract_state)
    assert int(state.step) == 4 and data_state == {"index": 4}
    wi = state.params["decoder"]["layer_0"]["ffn"]["wi"]["kernel"]
    assert wi.sharding.spec == P("fsdp", "tensor") and dict(wi.sharding.mesh.shape)["tensor"] == 4
    want, got = train_job.flat_params(result.state), train_job.flat_params(state)
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_average_of_last_checkpoints(run):
    workdir, _ = run
    trainer = _trainer((("data", 8),))
    ckpt = _ckpt(workdir)
    assert ckpt.all_steps() == [2, 4]
    states = [ckpt.restore(trainer.abstract_state, s)[0] for s in (2, 4)]
    avg = average_checkpoints(ckpt, trainer.abstract_state, 2)
    for a, s2, s4 in zip(jax.tree.leaves(avg), *(jax.tree.leaves(s.params) for s in states)):
        np.testing.assert_allclose(np.asarray(a), (np.asarray(s2) + np.asarray(s4)) / 2, rtol=1e-6)
    with pytest.raises(CheckpointError, match="average 3 checkpoints, found 2"):
        average_checkpoints(ckpt, trainer.abstract_state, 3)


def test_missing_and_mismatched_checkpoints_raise_clear_errors(run):
    workdir, _ = run
    ckpt = _ckpt(workdir)
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 99 .*available: \[2, 4\]"):
        ckpt.restore(_trainer((("data", 8),)).abstract_state, 99)
    wide = _trainer((("data", 8),), d_model=48)
    with pytest.raises(CheckpointError, match=r"ffn/wi/kernel: checkpoint shape \(32, 64\) vs config shape \(48, 64\)"):
        ckpt.restore(wide.abstract_state)
    with pytest.raises(CheckpointError, match="does not match"):  # same through the loop
        _resume_with(workdir, d_model=48)
    assert ckpt.all_steps() == [2, 4]


def _resume_with(workdir, fallback_to_older=True, **model_overrides):
    from tfm.train import train_and_evaluate
    return train_and_evaluate(train_job.config(6, fallback_to_older=fallback_to_older), workdir,
                              model=DecoderLM(tiny("decoder", **model_overrides)),
                              task=LMTask(), train_data=train_job.TokenBatches())


def _corrupt_latest(workdir, tmp_path):
    """A copy of the run's checkpoints with step 4's array files truncated."""
    shutil.copytree(os.path.join(workdir, "checkpoints"), tmp_path / "checkpoints")
    state_dir = tmp_path / "checkpoints" / "4" / "state"
    for root, _, files in os.walk(state_dir):
        for f in files:
            if not f.startswith("_"):
                open(os.path.join(root, f), "wb").close()  # truncate the array data


def test_corrupt_checkpoint_without_fallback_raises_and_deletes_nothing(run, tmp_path):
    workdir, _ = run
    _corrupt_latest(workdir, tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="checkpoint .*/4 .*(corrupt|unreadable).*fallback_to_older=True"):
        _resume_with(str(tmp_path), fallback_to_older=False)
    assert sorted(str(p) for p in tmp_path.rglob("*") if "metrics" not in str(p)
                  and "tensorboard" not in str(p)) == [p for p in before]


def test_corrupt_checkpoint_falls_back_to_the_older_one_and_keeps_it(run, tmp_path, capsys):
    workdir, _ = run
    _corrupt_latest(workdir, tmp_path)
    broken_files = sorted(p.relative_to(tmp_path / "checkpoints" / "4") for p in (tmp_path / "checkpoints" / "4").rglob("*"))
    result = _resume_with(str(tmp_path))
    out = capsys.readouterr().out
    assert "checkpoint step 4 is corrupt" in out and "restored checkpoint at step 2" in out, out
    assert int(result.state.step) == 6
    moved = list((tmp_path / "checkpoints.broken").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("4-")
    assert sorted(p.relative_to(moved[0]) for p in moved[0].rglob("*")) == broken_files  # moved whole


def test_only_orphaned_tensorstore_completions_are_silenced(monkeypatch):
    """After a failed read, tensorstore completes sibling reads on a closed asyncio loop; those
    are dropped (they printed tracebacks into the CLI's one-line error), nothing else is."""
    import asyncio
    import sys
    import types
    from tfm.train import checkpoint
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint._ignore_orphaned_reads()
    checkpoint._ignore_orphaned_reads()  # installed once, not stacked
    loop = asyncio.new_event_loop()
    loop.close()

    def report(fn, *args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            sys.unraisablehook(types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__))

    report(loop.call_soon_threadsafe, print)  # an orphaned completion: dropped
    report(loop.call_soon, print)             # same message, not from a cross-thread completion
    report(lambda: 1 / 0)
    assert [type(u.exc_value).__name__ for u in seen] == ["RuntimeError", "ZeroDivisionError"]


def _suspended_read(name):
    """A started, unfinished coroutine shaped like orbax's array read: it turns whatever ends its
    await (the GeneratorExit of being garbage-collected, too) into an Exception."""
    async def read(future):
        try:
            await future
        except BaseException as e:
            raise Exception("Encountered error while reading array index") from e
    read.__qualname__ = read.__name__ = name
    import asyncio
    coroutine = read(asyncio.Future(loop=asyncio.new_event_loop()))
    coroutine.send(None)
    return coroutine


def test_only_unfinished_orbax_reads_collected_after_a_failure_are_silenced(monkeypatch):
    """A sibling read coroutine of a failed restore, collected unfinished, printed a traceback for
    each array into the CLI's one-line error; the same from any other coroutine still reaches
    the hook."""
    import gc
    import sys
    from tfm.train import checkpoint
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint._ignore_orphaned_reads()
    for name in ("_read_array_index_and_device_put", "_write_array"):
        coroutine = _suspended_read(name)
        del coroutine
        gc.collect()
    assert [u.object.__qualname__ for u in seen] == ["_write_array"]
    assert isinstance(seen[0].exc_value.__cause__, GeneratorExit)
