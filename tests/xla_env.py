"""XLA flags of the test processes and of the commands they start.

The tests' programs are tiny, so XLA:CPU's compile time is most of their time. LLVM at -O0 without
its expensive passes compiles them in about half the CPU time (tests/test_parallel_families.py:
99 -> 57 CPU s); XLA:CPU's older loop emitters in place of its MLIR fusion emitters, scheduled without
the concurrency-optimising scheduler, take another ~40% off (test_models.py 114 -> 67 CPU s,
test_mixers.py 81 -> 49, of which backend compiles 64 -> 28 and 45 -> 23 s; either change alone
saves less or nothing). The arithmetic can differ from the defaults' in the last bits, so a command
a test compares with its own results compiles with the same flags. Users' runs keep XLA's defaults."""
from __future__ import annotations

import os
from typing import Optional

COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false --xla_cpu_enable_concurrency_optimized_scheduler=false")


def flags(devices: Optional[int] = None) -> str:
    """XLA_FLAGS: the compile flags, and `devices` simulated CPU devices (None: one)."""
    return COMPILE_FLAGS + ("" if devices is None else f" --xla_force_host_platform_device_count={devices}")


def subprocess_env(devices: Optional[int] = None, **changes: str) -> dict:
    """This process's environment for a command it starts: XLA_FLAGS set by `flags(devices)`."""
    return {**os.environ, "XLA_FLAGS": flags(devices), **changes}
