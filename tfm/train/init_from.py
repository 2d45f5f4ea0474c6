"""Initialising a model from another run's weights: fine-tuning a pretrained encoder with a new
head, or growing a model. `checkpoint_params` reads a run's params through its Checkpointer;
`merge_params` puts them into a freshly initialised params tree; `InitFromParams` does that
on a fresh run's first step (a resumed run already holds its own weights).
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from flax import traverse_util

from tfm.train.checkpoint import Checkpointer
from tfm.train.hooks import Hook


def checkpoint_params(directory: str, step: Optional[int] = None) -> tuple[dict, int]:
    """(params as numpy arrays, step) of checkpoint `step` (default: the newest) in `directory`
    (a run's <workdir>/checkpoints), read-only; CheckpointError if there is none or it is corrupt."""
    return Checkpointer(directory, read_only=True).restore_params(step)


def merge_params(fresh: dict, loaded: dict, *, source: str, optional: tuple[str, ...] = ()) -> dict:
    """`fresh` (the new model's initialised params) with every `loaded` param in its place, in
    fresh's dtype (and sharding, for jax arrays); params only `fresh` has keep their init.
    Top-level modules named in `optional` are dropped when `fresh` has none. ValueError naming
    (after `source`) a loaded param that has no place or another shape."""
    flat = traverse_util.flatten_dict(fresh, sep="/")
    for name, value in traverse_util.flatten_dict(loaded, sep="/").items():
        if name.split("/")[0] in optional and name.split("/")[0] not in fresh:
            continue
        if name not in flat:
            raise ValueError(f"{source}: param {name} has no place in the model")
        target = flat[name]
        if tuple(np.shape(value)) != tuple(target.shape):
            raise ValueError(f"{source}: param {name} has shape {tuple(np.shape(value))}, "
                             f"the model {tuple(target.shape)}")
        value = np.asarray(value, target.dtype)
        flat[name] = jax.device_put(value, target.sharding) if isinstance(target, jax.Array) else value
    return traverse_util.unflatten_dict(flat, sep="/")


class InitFromParams(Hook):
    """On a fresh run (step 0), puts `params` into the initialised state (merge_params); the
    params they lack (a new head) keep their init. A resumed run already holds its own."""

    def __init__(self, params: dict, *, source: str, optional: tuple[str, ...] = ()):
        self.params, self.source, self.optional = params, source, optional

    def start(self, run):
        if run.step:
            return
        run.state = run.state.replace(params=merge_params(run.state.params, self.params, source=self.source,
                                                          optional=self.optional))
        new = sorted(set(run.state.params) - set(self.params))
        run.logger.message(f"initialised from {self.source}; newly initialised: {new}")
