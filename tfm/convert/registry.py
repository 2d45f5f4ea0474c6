"""Every Hugging Face architecture tfm converts: {HF class name: `Converter`}.

A family registers itself by being a module of this package with an `ARCHITECTURES` dict: nothing here
names it. Import (`importer.from_hf`) and export (`export.to_hf`) both read the table; the family modules
know nothing of it, so imports run one way: common <- families <- registry <- importer <- export.
"""
from __future__ import annotations

import importlib
import os
import pkgutil

# The package's modules that hold no family.
_MACHINERY = {"common", "export", "importer", "loading", "registry"}


def _families():
    """(module name, its ARCHITECTURES) of every family module, in name order."""
    for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda m: m.name):
        if info.name not in _MACHINERY:
            yield info.name, importlib.import_module(f"{__package__}.{info.name}").ARCHITECTURES


# Order matters for export: with no architecture named, `to_hf` writes the first class here whose config
# reproduces the tfm config, so the table runs by each converter's export_rank, then module name (a Llama config
# may also be a Mistral one; a Mamba-2 model is also a Nemotron-H whose every layer is "M").
_ENTRIES = [(c.export_rank, module, i, arch, c) for module, archs in _families()
            for i, (arch, c) in enumerate(archs.items())]
CONVERTERS = {arch: c for *_, arch, c in sorted(_ENTRIES, key=lambda e: e[:3])}
SUPPORTED = tuple(sorted(CONVERTERS))
