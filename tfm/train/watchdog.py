"""Progress watchdog: a step, an evaluation or a save that stops making progress ends the job.

A process whose main thread is stuck (a read from a network filesystem that never returns, a
collective a peer never joins, a wedged accelerator) keeps its heartbeat thread beating, so the
lost-host watch (tfm.parallel.distributed) never fires and the job burns its reservation. The loop
tells the `Watchdog` where it is (`enter(step, phase)`) and hands it each step's loss
(`dispatched`), whose readiness marks the step finished on the devices. A thread looks every
`poll` seconds at how long it has been since the last progress (a new phase, a finished step);
past the phase's bound (a step or batch read: max(timeout, factor x the median step), or
`slow_timeout` before a step time is known; the first step's compile, a save, an evaluation:
`slow_timeout`) it ends the job with exit status 75 and one line naming the process furthest
behind, its step and its phase. With several processes each publishes its position in JAX's
key-value store; the first to time out publishes the line, every process prints it, and each
exits once all have seen it (process 0, which holds the store, last).
"""
from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import threading
import time
from typing import Optional

import jax

from tfm.parallel.distributed import EXIT_LOST_PROCESS

PHASES = ("data", "compile", "step", "save", "eval", "finish")  # a step's phases in order
SLOW = ("compile", "save", "eval", "finish")                    # bounded by slow_timeout
_KEY = "tfm/watchdog"


class Watchdog:
    """See the module doc; `timeout` 0 makes every method a no-op."""

    def __init__(self, timeout: float = 0.0, factor: float = 20.0, slow_timeout: float = 3600.0):
        self.timeout, self.factor, self.slow_timeout = timeout, factor, slow_timeout
        self.poll = min(max(timeout / 20, 0.05), 2.0)
        self.where = (0, "data", time.monotonic())  # (step, phase, since): one tuple, swapped whole
        self.pending, self.steps = collections.deque(), collections.deque(maxlen=100)
        self.done_at, self.stopping, self.thread, self.client = None, None, None, None
        self.halt = threading.Event()

    @classmethod
    def from_config(cls, config) -> "Watchdog":
        return cls(config.watchdog_timeout, config.watchdog_step_factor, config.watchdog_slow_timeout)

    def start(self, step: int) -> None:
        if not self.timeout:
            return
        self.enter(step + 1, "compile")
        if jax.process_count() > 1:
            from jax._src import distributed  # the key-value store JAX's coordinator holds
            self.client = distributed.global_state.client
        self.thread = threading.Thread(target=self._watch, name="tfm-watchdog", daemon=True)
        self.thread.start()

    def enter(self, step: int, phase: str) -> None:
        self.where = (step, phase, time.monotonic())

    @contextlib.contextmanager
    def phase(self, step: int, phase: str):
        """`phase` of `step` for the duration; then back to the phase before, its clock restarted."""
        before = self.where
        self.enter(step, phase)
        try:
            yield
        finally:
            self.enter(before[0], before[1])

    def dispatched(self, loss: jax.Array) -> None:
        """A step's output, ready once the step has finished on this process's devices."""
        if self.timeout:
            self.pending.append(loss)

    def stop(self) -> None:
        """Ends the watch and waits for its thread (none may be inside a call into JAX at exit)."""
        self.halt.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(max(10 * self.poll, 5.0))

    def settle(self) -> None:
        """On the main thread's way out with an error: if the watchdog is ending the job (a peer that
        stopped making progress exits, failing this process's collectives), wait for it to."""
        if self.stopping is not None:
            while True:
                time.sleep(60)

    def bound(self, phase: str) -> tuple[float, str]:
        """(seconds without progress allowed in `phase`, how that was set)."""
        if phase in SLOW or not self.steps:
            return self.slow_timeout, f"watchdog_slow_timeout={self.slow_timeout:g} s"
        median = statistics.median(self.steps)
        limit = max(self.timeout, self.factor * median)
        return limit, (f"max(watchdog_timeout={self.timeout:g} s, watchdog_step_factor={self.factor:g} x the "
                       f"median step {median:.2g} s)")

    def _finished_steps(self, now: float) -> None:
        done = 0
        while self.pending and self._ready(self.pending[0]):
            self.pending.popleft()
            done += 1
        if not done:
            return
        if self.done_at is not None:  # the first finished step's time is mostly its compile
            self.steps.extend([(now - self.done_at) / done] * done)
        self.done_at = now
        step, phase, since = self.where
        self.where = (step, phase, max(since, now))

    @staticmethod
    def _ready(x: jax.Array) -> bool:
        try:
            return x.is_ready()
        except Exception:  # noqa: BLE001 - the step failed: the main thread raises it
            return True

    def _watch(self) -> None:
        published = None
        while not self.halt.wait(self.poll):
            now = time.monotonic()
            self._finished_steps(now)
            step, phase, since = self.where
            if self.client is not None:
                line = self._published()
                if line is not None:
                    self._end(line)
                if (step, phase) != published and self._store(self.client.key_value_set, f"{_KEY}/at/"
                                                               f"{jax.process_index()}", f"{step} {phase}", True)[0]:
                    published = (step, phase)
            limit, why = self.bound(phase)
            if now - since > limit:
                self._end(self._line(step, phase, limit, why), publish=True)

    @staticmethod
    def _store(call, *args) -> tuple[bool, object]:
        """(True, `call(*args)`) on the key-value store, or (False, None) where it fails: a key not set
        yet, another process's key set first, or the store gone with process 0 (the lost-host watch
        reports that)."""
        try:
            return True, call(*args)
        except Exception:  # noqa: BLE001 - the client raises one type for every failure
            return False, None

    def _published(self) -> Optional[str]:
        return self._store(self.client.key_value_try_get, f"{_KEY}/stop")[1]

    def _line(self, step: int, phase: str, limit: float, why: str) -> str:
        """The stop line, naming the process furthest behind (every process's position from the store)."""
        me, count = jax.process_index(), jax.process_count()
        where = {me: (step, phase)}
        if self.client is not None:
            for key, value in self._store(self.client.key_value_dir_get, f"{_KEY}/at/")[1] or []:
                process = int(key.rsplit("/", 1)[1])
                if process != me:
                    at_step, at_phase = value.split()
                    where[process] = (int(at_step), at_phase)
        rank = {p: (s, PHASES.index(ph)) for p, (s, ph) in where.items()}
        behind = sorted(p for p in rank if rank[p] == min(rank.values()))
        step, phase = where[behind[0]]
        who = f"process {behind[0]}" if len(behind) == 1 else "processes " + ", ".join(map(str, behind))
        return (f"error: {who} of {count} stopped making progress in step {step} (phase: {phase}): nothing moved for "
                f"{limit:.3g} s, the bound {why}. Every process of the job stopped; run the same command again on "
                "every host: it resumes from the last good checkpoint")

    def _end(self, line: str, publish: bool = False) -> None:
        if self.client is not None:
            if publish and not self._store(self.client.key_value_set, f"{_KEY}/stop", line)[0]:
                line = self._published() or line  # another process published first: its line stands
            self.stopping = line
            me, count = jax.process_index(), jax.process_count()
            self._store(self.client.key_value_set, f"{_KEY}/seen/{me}", "1", True)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and len(self._store(self.client.key_value_dir_get, f"{_KEY}/seen/")[1]
                                                      or range(count)) < count:
                time.sleep(0.05)
            if me == 0:
                time.sleep(0.5)  # the others exit first: this process holds the store they read
        self.stopping = line
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(EXIT_LOST_PROCESS)
