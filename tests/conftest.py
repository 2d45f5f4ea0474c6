"""Shared test setup (before JAX starts a backend): 8 simulated CPU devices, CPU as JAX's only
backend, and the compile-only TPU/CUDA plugins of `make compile-plugins` importable in this
process (subprocesses of the tests do not see them, as a user's CPU runs do not).

The commands the tests run as subprocesses (training CLIs, the notebooks' kernels, gpu_check)
share JAX's persistent compilation cache, one fresh directory per test process (an xdist worker
runs its files one at a time, so no two processes of different files write it at once): the
second run of the same tiny recipe loads its steps instead of compiling them. This process
itself keeps compiling in memory (JAX read its configuration when tfm imported it, above)."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tfm.preflight.targets import use_plugins  # noqa: E402

use_plugins()

_JAX_CACHE = tempfile.mkdtemp(prefix="tfm-tests-jax-cache-")
atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=_JAX_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
