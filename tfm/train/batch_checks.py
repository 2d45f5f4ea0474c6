"""Checks a process-local batch before it becomes a global array: every id entry the task
declares (`Task.id_fields`) must lie in its range, so a bad id stops the run with the entry,
the value and the row, not a wrapped embedding or an unexplained NaN loss several steps later.

Host numpy, one pass over each id entry: cheap beside a train step.
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.train.tasks import IdField, Task


def check_batch(task: Task, batch: dict, config: ModelConfig) -> None:
    """Raises ValueError naming the first id outside its range in `batch` (entries the batch
    does not hold are skipped; a missing weights entry means every position counts)."""
    for field in task.id_fields(config, batch):
        if field.key in batch:
            _check_field(batch, field)


def _check_field(batch: dict, field: IdField) -> None:
    ids = np.asarray(batch[field.key])
    bad = (ids < 0) | (ids >= field.bound)
    if field.weights in batch:
        bad &= np.asarray(batch[field.weights]) != 0
    if not bad.any():
        return
    where = np.unravel_index(np.argmax(bad), bad.shape)
    at = f"row {where[0]}" + (f", position {where[1]}" if len(where) > 1 else "")
    weighted = f" (where {field.weights} != 0)" if field.weights in batch else ""
    raise ValueError(f"batch[{field.key!r}] has id {ids[where]} outside [0, {field.bound}){weighted} "
                     f"at {at} of this process's batch; {int(bad.sum())} such value(s) in all")
