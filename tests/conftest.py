"""Shared test setup (before JAX starts a backend): 8 simulated CPU devices, CPU as JAX's only
backend, and the compile-only TPU/CUDA plugins of `make compile-plugins` importable in this
process (subprocesses of the tests do not see them, as a user's CPU runs do not)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tfm.preflight.targets import use_plugins  # noqa: E402

use_plugins()
