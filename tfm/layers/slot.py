"""The Block's one token-mixer slot: every kind of ModelConfig.mixer_pattern, attention included, and
every feed-forward of ffn_pattern that reads more than its own token, is a module registered here by
the file that defines it (`register_mixer`, `register_ffn`); the Block looks kinds up and knows none.

A mixer is built as `module(config, causal=..., layer_index=..., name=kind.name)` (subclass `TokenMixer`
for those fields) and called as `(x [B, T, D], inputs: BlockInputs, deterministic, decode) -> [B, T, D]`:
the layer's input and its typed per-layer inputs (segment ids, positions, cross-attention memory, ...);
its decode cache is its own "cache" collection. A pattern entry "a+b" is a parallel composite: both
mixers read the same normed input and their outputs are summed (ModelConfig.mixer_multipliers scale
each branch's input and output).

Registration happens on import: `kind()` / `kinds()` first import every module of `tfm.layers`, so a
new mixer is one module that registers itself (and, if it is configured, one group in tfm.config
decorated with `mixer_group`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
from typing import Dict

import flax.linen as nn

from tfm import config
from tfm.config import ModelConfig


class TokenMixer(nn.Module):
    """The fields every registered mixer is built with: the model's config, whether the stack is causal,
    and the layer's place in it (its kinds under the config's patterns)."""

    config: ModelConfig
    causal: bool = True
    layer_index: int = 0


@dataclasses.dataclass(frozen=True)
class MixerKind:
    """A registered mixer: its module, the name of its parameters (and cache) in its Block, the prefix
    of its norm's name (`{norm}_norm`), and whether it may sit in a bidirectional stack (an encoder)."""

    module: type
    name: str = "mixer"
    norm: str = "mixer"
    bidirectional: bool = False


_MIXERS: Dict[str, MixerKind] = {}
_FFNS: Dict[str, type] = {}
_SKIP = {"slot", "block", "stack", "inputs"}  # tfm.layers modules that define no mixer (and import this one)


def register_mixer(kind: str, module: type, *, name: str = "mixer", norm: str = "mixer",
                   bidirectional: bool = False) -> None:
    """Makes `kind` a mixer_pattern entry computed by `module` (see the module docstring)."""
    if kind in _MIXERS or kind == "none" or "+" in kind:
        raise ValueError(f"mixer kind {kind!r} is taken or reserved")
    _MIXERS[kind] = MixerKind(module, name, norm, bidirectional)
    config.register_kind(kind)


def register_ffn(kind: str, module: type) -> None:
    """Makes `kind` an ffn_pattern entry computed by `module(config, name="ffn")(x, segment_ids, decode)`
    (a feed-forward that reads more than its own token, like RWKV's channel mix)."""
    _FFNS[kind] = module
    config.register_kind(kind, ffn=True)


@functools.lru_cache(maxsize=None)
def _discover() -> None:
    """Imports every module of tfm.layers once (each registers its kinds)."""
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if info.name not in _SKIP:
            importlib.import_module(f"{__package__}.{info.name}")


def kind(name: str) -> MixerKind:
    """The registered mixer `name`."""
    _discover()
    if name not in _MIXERS:
        raise ValueError(f"ModelConfig.mixer_pattern kind {name!r} has a config group but no registered module; "
                         f"register one with tfm.layers.slot.register_mixer")
    return _MIXERS[name]


def kinds() -> tuple:
    """Every registered mixer kind, and "none" (a layer without a mixer)."""
    _discover()
    return tuple(_MIXERS) + ("none",)


def ffn(name: str):
    """The feed-forward module registered as `name`, or None (dense, MoE and "none" are the Block's own)."""
    _discover()
    return _FFNS.get(name)
