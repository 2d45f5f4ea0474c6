"""Orbax checkpoints: the train state plus each host's data-iterator state.

Layout: <workdir>/checkpoints/<step>/{state, data}. `state` is the sharded TrainState
(restorable onto any mesh: arrays are read straight into the target shardings); `data`
holds one JSON file per process with its iterator's `get_state()`.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tfm.train.optim import param_path


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the configured model."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are unreadable (truncated, partial); an older one may be fine."""


def _data_state_json(state) -> str:
    """An iterator state (dict, or bytes stored base64) as the JSON of a checkpoint's data item."""
    if isinstance(state, bytes):
        state = {"__bytes__": base64.b64encode(state).decode()}
    return json.dumps(state)


def _data_state_name() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


class DataStateHandler(ocp.CheckpointHandler):
    """Per-process JSON of an iterator state (dict, or bytes stored base64)."""

    def save(self, directory: epath.Path, args):
        (directory / _data_state_name()).write_text(_data_state_json(args.state))

    def restore(self, directory: epath.Path, args=None):
        path = directory / _data_state_name()
        if not path.exists():
            raise CheckpointError(f"no data-iterator state for this process at {path} "
                                  "(was the checkpoint written with a different process count?)")
        state = json.loads(path.read_text())
        if isinstance(state, dict) and "__bytes__" in state:
            state = base64.b64decode(state["__bytes__"])
        return state

    def metadata(self, directory):
        return None

    def structure(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class DataStateArgs(ocp.args.CheckpointArgs):
    state: Any = None


def _is_orphaned_read(unraisable) -> bool:
    """Leftovers of a checkpoint read that failed, which nobody wants any more: a tensorstore read
    finishing after the asyncio loop that awaited it was closed (orbax closes it when a sibling
    read of the same checkpoint fails), or a sibling orbax read coroutine garbage-collected
    unfinished (orbax turns the GeneratorExit that closes it into an Exception)."""
    frames, tb = [], unraisable.exc_traceback
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    error = unraisable.exc_value
    late_completion = (unraisable.exc_type is RuntimeError and str(error) == "Event loop is closed"
                       and "call_soon_threadsafe" in frames)
    coroutine = getattr(unraisable, "object", None)
    closed_read = (getattr(coroutine, "__qualname__", "") == "_read_array_index_and_device_put"
                   and isinstance(getattr(error, "__cause__", None), GeneratorExit))
    return late_completion or closed_read


def _ignore_orphaned_reads() -> None:
    """Installs (once) an unraisable-exception hook that drops those completions, which tensorstore
    reports from its own threads at any time after the failed read, even into the one-line
    error of the command line; every other unraisable exception reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "_tfm_orphaned_reads", False):
        return

    def hook(unraisable):
        if not _is_orphaned_read(unraisable):
            previous(unraisable)

    hook._tfm_orphaned_reads = True
    sys.unraisablehook = hook


class _OrbaxErrorsReported(logging.Filter):
    """Drops orbax's own error records (with their thread tracebacks): every failure of a save or a
    restore reaches the user as tfm's one-line CheckpointError instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


def _quiet_orbax_errors() -> None:
    """Installs the filter (once) on the loggers orbax writes through (absl's and the root's handlers)."""
    for handler in logging.getLogger().handlers + logging.getLogger("absl").handlers:
        if not any(isinstance(f, _OrbaxErrorsReported) for f in handler.filters):
            handler.addFilter(_OrbaxErrorsReported())


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def directory_bytes(path: str) -> int:
    """Bytes of the files under `path` (a checkpoint step, a corpus)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _cause(error: BaseException) -> str:
    """`Type: message` of the innermost exception in `error`'s chain (where tensorstore names the
    array and file that failed and why), without the reprs of TensorStore specs it appends."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    text = re.sub(r"\s*(\[tensorstore_spec=|See full TensorStore details:).*", "", str(error), flags=re.S)
    return f"{type(error).__name__}: {text}"


def _paths(tree) -> dict:
    """{"params/decoder/…/kernel": leaf}, the same for dataclass and dict trees."""
    return {param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_compatible(saved_metadata, abstract_state, where: str) -> None:
    """Raise CheckpointError naming every leaf whose presence or shape differs."""
    saved = {k: tuple(v.shape) for k, v in _paths(saved_metadata).items() if hasattr(v, "shape")}
    wanted = {k: tuple(v.shape) for k, v in _paths(abstract_state).items()}
    problems = [f"  {k}: missing in checkpoint" for k in wanted if k not in saved]
    problems += [f"  {k}: in checkpoint but not in the model" for k in saved if k not in wanted]
    problems += [f"  {k}: checkpoint shape {saved[k]} vs config shape {wanted[k]}"
                 for k in wanted if k in saved and saved[k] != wanted[k]]
    if problems:
        raise CheckpointError(f"checkpoint {where} does not match the configured model:\n"
                              + "\n".join(problems[:20]))


class Checkpointer:
    """Saves every `every` steps (async), keeps the last `keep`, restores the latest.
    `read_only`: neither creates the directory nor saves (reading another run's checkpoints)."""

    def __init__(self, directory, *, every: int = 1000, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = epath.Path(directory)
        self.every, self.async_save, self.read_only = every, async_save, read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=max(every, 1), create=not read_only,
            enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": DataStateHandler()})
        _quiet_orbax_errors()
        _ignore_orphaned_reads()

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_state=None, *, force: bool = False) -> bool:
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only: not saving step {step}")
        items = {"state": ocp.args.StandardSave(state)}
        if data_state is not None:
            items["data"] = DataStateArgs(data_state)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def _state_metadata(self, step: Optional[int]):
        """The saved train state's metadata tree at `step`; CheckpointError if there is no such
        step, CorruptCheckpointError if its files cannot be read."""
        if step is None or step not in self.all_steps():
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory} "
                                  f"(available: {self.all_steps()})")
        where = f"{self.directory}/{step}"
        try:
            meta = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - orbax raises many types for unreadable files
            raise CorruptCheckpointError(f"checkpoint {where} is unreadable (corrupt or partial): "
                                         f"{_cause(e)}") from e
        if meta is None:
            raise CorruptCheckpointError(f"checkpoint {where} has no train state (corrupt or partial)")
        return meta

    def restore(self, abstract_state, step: Optional[int] = None, *, with_data: bool = True):
        """(state, data_state or None) at `step` (default latest), onto the shardings of
        `abstract_state` (a tree of jax.ShapeDtypeStruct with .sharding)."""
        step = self.latest_step() if step is None else step
        where = f"{self.directory}/{step}"
        meta = self._state_metadata(step)
        check_compatible(meta, abstract_state, where)
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        has_data = with_data and (self.directory / str(step) / "data").exists()
        if has_data:
            items["data"] = DataStateArgs()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CorruptCheckpointError(f"checkpoint {where} could not be restored (corrupt or "
                                         f"partial): {_cause(e)}") from e
        return restored["state"], (restored["data"] if has_data else None)

    def restore_params(self, step: Optional[int] = None) -> tuple[dict, int]:
        """(params as numpy arrays, step) of checkpoint `step` (default latest), on the host and
        onto no mesh: the optimizer and data states are not read. For initialising another model
        from this run's weights (tfm.train.init_from)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.directory} holds no checkpoint")
        where = f"{self.directory}/{step}"
        meta = self._state_metadata(step)
        if "params" not in meta:
            raise CorruptCheckpointError(f"checkpoint {where} has no params (corrupt or partial)")
        item = {"params": jax.tree.map(lambda m: np.zeros((), m.dtype), meta["params"])}
        args = ocp.args.PyTreeRestore(
            item=item, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item),
            partial_restore=True)
        try:  # the state item alone, as a plain pytree: StandardRestore cannot leave out opt_state
            restored = ocp.PyTreeCheckpointer().restore(self.directory / str(step) / "state", args=args)
        except Exception as e:  # noqa: BLE001
            raise CorruptCheckpointError(f"checkpoint {where} could not be restored (corrupt or "
                                         f"partial): {_cause(e)}") from e
        return restored["params"], step

    def rewrite_data_state(self, step: int, data_state) -> None:
        """Replaces this process's data-iterator state in the saved checkpoint `step` (a spike
        recovery's skipped batches), written beside it and renamed over it."""
        path = self.directory / str(step) / "data" / _data_state_name()
        if not path.exists():
            raise CheckpointError(f"checkpoint {self.directory}/{step} holds no data-iterator state to rewrite")
        temporary = path.parent / f"{path.name}.tmp"
        temporary.write_text(_data_state_json(data_state))
        os.replace(os.fspath(temporary), os.fspath(path))

    def set_aside(self, step: int) -> str:
        """Moves step `step` out of the way (never deletes it): to <directory>.broken/<step>-<time>."""
        target = self.directory.parent / f"{self.directory.name}.broken" / f"{step}-{int(time.time())}"
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"tfm: checkpoint {step} set aside")
        self.manager.reload()
        return str(target)

    def check_background_save(self, wait: bool = False) -> None:
        """Raises CheckpointError if an asynchronous save that has finished (with `wait`: any
        save still running, once finished) failed."""
        try:
            if wait:
                self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - whatever the writer raised
            raise CheckpointError(f"saving a checkpoint in the background failed: "
                                  f"{type(e).__name__}: {e}") from e

    def discard_partial(self, step: int) -> None:
        """Removes what a failed save of `step` left (orbax's `<step>.orbax-checkpoint-tmp*`), which a
        resumed run would ignore anyway; it frees the space it took."""
        if jax.process_index() == 0:
            for path in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(os.fspath(path), ignore_errors=True)

    def out_of_space(self, cause: BaseException) -> Optional[str]:
        """When a save failed for a full device, "no space left on the device of DIR (F free, a
        checkpoint takes C)"; else None."""
        if "No space left on device" not in str(cause) and getattr(cause, "errno", None) != 28:
            return None
        free = shutil.disk_usage(os.fspath(self.directory)).free
        steps = [s for s in self.all_steps() if (self.directory / str(s)).exists()]
        size = f", a checkpoint takes {_bytes(directory_bytes(os.fspath(self.directory / str(steps[-1]))))}" if steps else ""
        return f"no space left on the device of {self.directory} ({_bytes(free)} free{size})"

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def average_checkpoints(checkpointer: Checkpointer, abstract_params_state, last_k: int):
    """Mean of the params of the last `last_k` checkpoints (fp32 accumulation), as in
    Vaswani et al.'s averaging of the last checkpoints. Returns a params tree."""
    steps = checkpointer.all_steps()[-last_k:]
    if len(steps) < last_k:
        raise CheckpointError(f"asked to average {last_k} checkpoints, found {len(steps)} "
                              f"in {checkpointer.directory}")
    total = None
    for step in steps:
        state, _ = checkpointer.restore(abstract_params_state, step, with_data=False)
        params = jax.tree.map(lambda x: x.astype(jnp.float32), state.params)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
    return jax.tree.map(lambda t, ref: (t / len(steps)).astype(ref.dtype), total,
                        state.params)

