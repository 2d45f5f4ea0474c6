"""Shared test setup (before jax is imported): 8 simulated CPU devices, CPU as JAX's only
backend, and the compile-only TPU/CUDA plugins of `make compile-plugins` importable in this
process (subprocesses of the tests do not see them, as a user's CPU runs do not)."""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_PLUGINS = os.environ.get("TFM_COMPILE_PLUGINS", os.path.join(sys.prefix, "compile-only"))
if os.path.isdir(_PLUGINS):
    sys.path.append(_PLUGINS)
