"""Shared test setup (before JAX starts a backend): 8 simulated CPU devices, CPU as JAX's only
backend, and the compile-only TPU/CUDA plugins of `make compile-plugins` importable in this
process (subprocesses of the tests do not see them, as a user's CPU runs do not).

Compiled programs are shared through JAX's persistent compilation cache, in a fresh directory per
test process (an xdist worker runs one test at a time, so no two processes of different tests
write it at once): a test that builds the same step as an earlier one, in this process or in a
command it runs (training CLIs, the notebooks' kernels), loads it instead of compiling it again.
The cache is keyed by the program's HLO, compiler and devices, so a changed program compiles."""
import os
import shutil
import tempfile

import xla_env

xla_env.one_core_per_worker()  # before JAX starts: its thread pools are sized by the cores it may use
os.environ.setdefault("XLA_FLAGS", xla_env.flags(devices=8))  # LLVM -O0: xla_env says why
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_JAX_CACHE = tempfile.mkdtemp(prefix="tfm-tests-jax-cache-")
os.environ.update(JAX_COMPILATION_CACHE_DIR=_JAX_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

from tfm.preflight.targets import use_plugins  # noqa: E402

use_plugins()


def pytest_configure(config):
    # A compile-only TPU/GPU client (tfm.preflight.targets) writes entries it cannot load back; a
    # second compile of the same program for the same target warns so, then compiles as without a cache.
    config.addinivalue_line("filterwarnings", "ignore:Error reading persistent compilation cache entry"
                            ".*PjRtCompiler must be constructed with a Client:UserWarning")


def pytest_unconfigure(config):
    shutil.rmtree(_JAX_CACHE, ignore_errors=True)


# Files of few tests that run for minutes (notebooks, end-to-end commands). `make test` hands files
# to its two workers in the order below (--no-loadscope-reorder): these first, then the rest by
# their number of tests, as xdist orders them itself; last come the files of a few short tests, so
# that one worker does not spend the end of the run alone on a long file while the other idles.
LONG_FILES = ("test_notebooks.py", "test_run_safety.py", "test_readme.py", "test_gpu_check.py", "test_captioning.py",
              "test_faults.py", "test_translation_experiment.py", "test_multihost.py", "test_cli_errors.py")


def pytest_collection_modifyitems(config, items):
    count = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    rank = lambda item: (LONG_FILES.index(item.path.name) if item.path.name in LONG_FILES else len(LONG_FILES),
                         -count[item.path])
    items.sort(key=rank)  # stable: a file's tests keep their order
