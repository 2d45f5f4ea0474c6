"""XLA flags of the test processes and of the commands they start, and the cores they run on.

The tests' programs are tiny, so XLA:CPU's compile time is most of their time. LLVM at -O0 without
its expensive passes compiles them in about half the CPU time (tests/test_parallel_families.py:
99 -> 57 CPU s); XLA:CPU's older loop emitters in place of its MLIR fusion emitters, scheduled without
the concurrency-optimising scheduler, take another ~40% off (test_models.py 114 -> 67 CPU s,
test_mixers.py 81 -> 49, of which backend compiles 64 -> 28 and 45 -> 23 s; either change alone
saves less or nothing). The arithmetic can differ from the defaults' in the last bits, so a command
a test compares with its own results compiles with the same flags. Users' runs keep XLA's defaults."""
from __future__ import annotations

import contextlib
import os
from typing import Optional

_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []  # before any pinning

COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false --xla_cpu_enable_concurrency_optimized_scheduler=false")


def flags(devices: Optional[int] = None) -> str:
    """XLA_FLAGS: the compile flags, and `devices` simulated CPU devices (None: one)."""
    return COMPILE_FLAGS + ("" if devices is None else f" --xla_force_host_platform_device_count={devices}")


def subprocess_env(devices: Optional[int] = None, **changes: str) -> dict:
    """This process's environment for a command it starts: XLA_FLAGS set by `flags(devices)`."""
    return {**os.environ, "XLA_FLAGS": flags(devices), **changes}


def one_core_per_worker() -> None:
    """Pin each of `make test`'s xdist workers (and the commands it starts) to a core of its own when there
    are as many cores as workers. XLA then sizes its thread pools for one core: the same files took 6-8% less
    CPU time than two workers free to use both cores (test_models + test_faults beside test_zoo_recurrent +
    test_notebooks: 382 -> 352 CPU s; the multi-process files beside the model files: 419 -> 392), and the
    suite is CPU-bound on its two cores. Call before JAX starts a backend."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    if worker.startswith("gw") and 1 < count == len(_CORES):
        os.sched_setaffinity(0, {_CORES[int(worker[2:])]})


@contextlib.contextmanager
def every_core():
    """Commands started inside run on every core the tests started with, as on a user's machine: XLA's threads
    split its CPU work differently on one core, and the last bits of the arithmetic with it (`make demo` on one
    core prints another BLEU than the README's). Widens this thread's affinity, which a command inherits, and
    restores it after (a `preexec_fn` would make subprocess fork a multithreaded process)."""
    pinned = os.sched_getaffinity(0) if _CORES else None
    if pinned is not None:
        os.sched_setaffinity(0, _CORES)
    try:
        yield
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
