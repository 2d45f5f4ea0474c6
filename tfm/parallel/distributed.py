"""Multi-host initialisation.

On TPU pods and SLURM clusters `jax.distributed.initialize()` finds the coordinator, the
process count and the process id by itself; elsewhere (several processes on one machine,
plain GPU hosts) pass them explicitly or through TFM_COORDINATOR / TFM_NUM_PROCESSES /
TFM_PROCESS_ID.

A lost process (its host died, or kill -9) leaves the others blocked in a collective. JAX's own
heartbeat then aborts them with a fatal log that cannot be intercepted. So each process also
keeps a heartbeat of its own, a counter in JAX's key-value store, and watches the others': when
a peer's has not moved for TFM_HEARTBEAT_TIMEOUT seconds (default 60), or the store itself (on
process 0) has not answered for as long, the process prints one line naming the lost process and
what to run, and exits with status 75 (EX_TEMPFAIL: run again). JAX's heartbeat timeout is set to
twice that, so this comes first. At exit the processes meet before the watch stops (so none stops
beating while another still watches), and it stops between two calls into the store: a daemon thread
still inside one when the interpreter finalises aborts the process as it takes the GIL back.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # its key-value store client: the one JAX exposes

EXIT_LOST_PROCESS = 75  # EX_TEMPFAIL: the job can run again as it is
_heard = {}  # peer -> time.monotonic() its heartbeat (or the store's answer) last moved: the watch's view
_leaving = threading.Event()  # set at exit: the peer watch stops


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
    timeout = heartbeat_timeout()
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids, heartbeat_timeout_seconds=2 * timeout)
    if jax.process_count() > 1:
        client = jax_distributed.global_state.client
        watch = threading.Thread(target=_watch_peers, args=(client, timeout), name="tfm-peer-watch", daemon=True)
        watch.start()
        atexit.register(_leave, client, watch, timeout)  # runs before JAX's own shutdown (registered earlier)


def await_lost_peer() -> None:
    """After an error in a job of several processes (a collective whose peer is gone, a save that
    waited on it): a few heartbeats' time to see whether every peer still beats; while one is late,
    up to a heartbeat timeout and a half for the peer watch to name the lost process, which ends this
    one with its line and status. Returns when every peer beats (the error is something else)."""
    if jax.process_count() == 1 or not _heard:
        return
    timeout = heartbeat_timeout()
    start, late = time.monotonic(), 2 * _interval(timeout)  # a live peer beats every interval
    time.sleep(3 * _interval(timeout))
    while time.monotonic() - start < 1.5 * timeout and any(time.monotonic() - t > late for t in _heard.values()):
        time.sleep(0.2)


def _leave(client, watch: threading.Thread, timeout: int) -> None:
    """At exit (module doc): every process waits for the others (up to `timeout` s: one that never
    comes is gone, or its error ended it), then stops its watch and waits for the watch's thread."""
    try:
        client.wait_at_barrier("tfm/exit", 1000 * timeout)
    except Exception:  # noqa: BLE001 - a peer that did not come: leave anyway, as JAX's shutdown will
        pass
    _leaving.set()
    watch.join(timeout)


def _interval(timeout: int) -> float:
    return max(timeout / 10, 0.5)


def heartbeat_timeout() -> int:
    """Seconds without a peer's heartbeat after which this process gives it up (TFM_HEARTBEAT_TIMEOUT)."""
    value = os.environ.get("TFM_HEARTBEAT_TIMEOUT", "60")
    if not value.isdigit() or int(value) < 2:
        raise ValueError(f"TFM_HEARTBEAT_TIMEOUT={value!r}: give a whole number of seconds >= 2")
    return int(value)


def _watch_peers(client, timeout: int) -> None:
    """Beats this process's counter and watches every other's (module doc); on a loss, the last line."""
    me, count = jax.process_index(), jax.process_count()
    seen = {p: (None, time.monotonic()) for p in range(count) if p != me}  # last value, when it last moved
    store_ok = time.monotonic()
    _heard.update({p: since for p, (_, since) in seen.items()})
    while not _leaving.is_set():
        now = time.monotonic()
        try:
            client.key_value_increment(f"tfm/heartbeat/{me}", 1)
            for peer, (value, since) in seen.items():
                try:
                    beat = client.key_value_try_get(f"tfm/heartbeat/{peer}")
                except Exception:  # noqa: BLE001 - not yet written by a peer still starting
                    beat = value
                seen[peer] = (beat, now) if beat != value else (value, since)
            store_ok = now
        except Exception:  # noqa: BLE001 - the store (process 0) does not answer
            if now - store_ok > timeout:
                _lost(0, count, timeout, "the coordinator, holding the job's key-value store")
        for peer, (_, since) in seen.items():
            _heard[peer] = min(since, store_ok)
            if now - since > timeout:
                _lost(peer, count, timeout)
        _leaving.wait(_interval(timeout))


def _lost(peer: int, count: int, timeout: int, what: str = "") -> None:
    print(f"error: lost process {peer} of {count}{' (' + what + ')' if what else ''}: no heartbeat for {timeout} s "
          f"(TFM_HEARTBEAT_TIMEOUT). Run the same command again on every host: it resumes from the last good "
          f"checkpoint", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_PROCESS)


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
