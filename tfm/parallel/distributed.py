"""Multi-host initialisation.

On TPU pods and SLURM clusters `jax.distributed.initialize()` finds the coordinator, the
process count and the process id by itself; elsewhere (several processes on one machine,
plain GPU hosts) pass them explicitly or through TFM_COORDINATOR / TFM_NUM_PROCESSES /
TFM_PROCESS_ID.
"""
from __future__ import annotations

import os

import jax
import numpy as np


def _is_auto_cluster() -> bool:
    return "SLURM_JOB_ID" in os.environ or "TPU_WORKER_HOSTNAMES" in os.environ or \
        "CLOUD_TPU_TASK_ID" in os.environ or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> None:
    """Join the multi-host job; a no-op for a single process with nothing to join."""
    coordinator_address = coordinator_address or os.environ.get("TFM_COORDINATOR")
    if num_processes is None and "TFM_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["TFM_NUM_PROCESSES"])
    if process_id is None and "TFM_PROCESS_ID" in os.environ:
        process_id = int(os.environ["TFM_PROCESS_ID"])
    if coordinator_address is None and not _is_auto_cluster():
        return
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError("initialize: with an explicit coordinator address, num_processes and "
                         "process_id are needed too")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)


def is_primary() -> bool:
    """True on the process that writes logs and checkpoint metadata."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is true on any (one small all-gather when multi-host).

    The trainer asks this after each step, so a preemption signal that reaches one host makes
    all hosts save the same step and stop together instead of hanging in the next collective.
    """
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def from_process_0(flag: bool) -> bool:
    """Process 0's `flag` on every process (a broadcast when multi-host)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
