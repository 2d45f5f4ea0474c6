"""Resuming a run: its config records and its latest checkpoint.

A workdir records the config a run started with (config.json) and, when a resumed run's config
differs, the new one beside it (config.step<N>.json) with the changes named. A run restores the
newest readable checkpoint (a corrupt one set aside, never deleted, when asked) and the data
iterator's position; a refused restore names the config changes since the last record.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from typing import Iterator, Optional

import jax

from tfm.train.checkpoint import Checkpointer, CheckpointError, CorruptCheckpointError


def flat(d: dict, prefix: str = "") -> dict:
    """A nested config record as {"optimizer.learning_rate": value, ...}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_changes(old: dict, new: dict) -> list[str]:
    """"key: old -> new" for every flattened key whose value differs."""
    old, new = flat(old), flat(new)
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _restore_latest(checkpointer: Checkpointer, abstract_state, *, fallback: bool, say) -> tuple:
    """(state, data state) of the newest checkpoint; with `fallback`, a corrupt one is set
    aside (moved, never deleted) and the next older one tried."""
    while True:
        step = checkpointer.latest_step()
        try:
            return checkpointer.restore(abstract_state)
        except CorruptCheckpointError as e:
            if not fallback:
                raise CorruptCheckpointError(
                    f"{e}. To resume from the newest readable checkpoint instead, set "
                    "fallback_to_older=True (it moves broken ones aside), or move this step away.") from e
            moved = checkpointer.set_aside(step)
            say(f"checkpoint step {step} is corrupt ({str(e).splitlines()[0]}); moved it to {moved}, "
                "trying the next older one")
            if checkpointer.latest_step() is None:
                raise CorruptCheckpointError(_nothing_readable(checkpointer)) from e


def _nothing_readable(checkpointer: Checkpointer) -> str:
    """Why a workdir whose checkpoints were all set aside is not restarted, and how to."""
    broken = f"{checkpointer.directory}.broken"
    return (f"no readable checkpoint left in {checkpointer.directory}: the broken ones are in {broken}/ "
            f"(never deleted). To start over from step 0 deliberately (overwriting metrics.jsonl), move "
            f"{broken} out of the workdir, or use a new --workdir")


def latest_record(workdir: str) -> str:
    """The newest config record: config.json, or the config.step<N>.json of the largest N."""
    steps = [int(m.group(1)) for m in map(re.compile(r"config\.step(\d+)\.json$").match, os.listdir(workdir)) if m]
    return os.path.join(workdir, f"config.step{max(steps)}.json" if steps else "config.json")


def record_config(workdir: str, config_dict: Optional[dict], *, start: int, changes: list[str], say) -> None:
    """config.json for a new run; for a resumed run with changes since the latest record,
    config.step<start>.json beside it."""
    if config_dict is None or jax.process_index() != 0:
        return
    record, latest = os.path.join(workdir, "config.json"), latest_record(workdir)
    path = record if not os.path.exists(record) else os.path.join(workdir, f"config.step{start}.json")
    if path == record or changes:
        with open(path, "w") as f:
            json.dump(config_dict, f, indent=2, default=str)
    if changes:
        say(f"config changed since {latest} (new one in {path}):\n  " + "\n  ".join(changes))


def skip_trained(iterator, *, first, data_state, start: int, say) -> Iterator[dict]:
    """The batches still to train on after `start` steps (`first` was already drawn)."""
    if not start:
        return itertools.chain([first], iterator)
    if data_state is not None and hasattr(iterator, "set_state"):
        iterator.set_state(data_state)
    elif start > 1:
        say(f"data iterator has no saved state: skipping {start - 1} batches")
        for _ in range(start - 1):  # `first` was one of them
            next(iterator)
    return iterator


def changes_since_record(workdir: str, config_dict: Optional[dict]) -> tuple[str, list[str]]:
    """(the latest config record's path, how `config_dict` differs from it: none where there is
    no record or no config to compare)."""
    record = latest_record(workdir)
    if config_dict is None or not os.path.exists(record):
        return record, []
    with open(record) as f:
        return record, config_changes(json.load(f), json.loads(json.dumps(config_dict, default=str)))


def initial_state(trainer, checkpointer: Checkpointer, *, fallback: bool, record: str,
                  changes: list[str], say) -> tuple:
    """(state, data state) for a set-up `Trainer`: the newest readable checkpoint's, or a fresh init where the workdir
    has none. A workdir whose checkpoints were all set aside is refused; a refused restore names
    the config changes since `record`, the likely cause."""
    if checkpointer.latest_step() is None:
        if os.path.isdir(f"{checkpointer.directory}.broken"):
            raise CheckpointError(_nothing_readable(checkpointer))
        return trainer.init_state(), None
    try:
        return _restore_latest(checkpointer, trainer.abstract_state, fallback=fallback, say=say)
    except CheckpointError as e:
        if changes:
            raise CheckpointError(f"{e}\nThe config changed since {record} was written:\n  "
                                  + "\n  ".join(changes)) from e
        raise
