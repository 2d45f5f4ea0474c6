"""tfm: JAX/Flax transformers for all three families, sharded training, Pallas attention.

`import tfm` is cheap; each subpackage loads on first use, so `tfm.convert.from_hf(...)`,
`tfm.models.DecoderLM`, `tfm.train.Trainer` and `tfm.decode.sample_lm` work after it without
importing JAX, TensorFlow Datasets or torch before they are needed.
"""
from __future__ import annotations

import importlib

SUBMODULES = ("config", "convert", "data", "decode", "kernels", "layers", "models", "ops",
              "parallel", "preflight", "train")

__all__ = list(SUBMODULES)


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tfm' has no attribute {name!r}; its subpackages are {list(SUBMODULES)}")


def __dir__():
    return sorted(set(globals()) | set(SUBMODULES))
