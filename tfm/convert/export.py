"""Hugging Face export: tfm (ModelConfig, params) -> a transformers checkpoint directory.

    tfm.convert.to_hf(config, params, "out/")        # config.json + model.safetensors
    model = transformers.AutoModelForCausalLM.from_pretrained("out/")

How it works. Every importer (`Converter.params`) builds tfm params from HF tensors with layout
changes only (transpose, reshape, split, slice, stack), so it is a bijection between element
positions, and export runs it backwards instead of keeping a second, hand-written copy of every
family's tensor names (which could drift from the importer):

1. The family's config writer (`Converter.hf_config`, the inverse of `Converter.config`) gives
   the HF config; importing that config must give back the tfm config, otherwise HF cannot
   express it and export refuses, naming the fields that differ.
2. The HF model is built on torch's meta device (no memory) for its tensor names and shapes.
3. The importer runs on placeholder tensors holding each element's global index (`_Recorder`):
   every tfm leaf comes out as the indices of the HF elements it holds, so one scatter
   `hf[index] = tfm value` writes every HF tensor exactly. `w.tied(key, reference)` records that
   `key` holds `reference`'s elements (tied output, MLM decoder bias, shared embeddings).
4. `save_pretrained(directory, state_dict=...)` of the meta model writes the files as HF expects:
   tied copies dropped, `_keys_to_ignore_on_save` left out (Marian's position tables, which HF
   recomputes), checkpoint layouts restored (Mixtral's per-expert w1/w2/w3), config.json.
5. The directory is imported again and must give the same config and bit-identical params; an
   importer that did arithmetic instead of a layout change would fail here, never silently.

Adding a family: give its `Converter` an `hf_config(tfm_config) -> dict` holding `model_type`
and the fields the family's `config` reads (helpers in `common`: `hf_activation`, `hf_rope`); write
only what HF has a field for, and let the round-trip check refuse the rest. An HF tensor the
importer does not read is an error naming it: nothing is written as a placeholder. Importers must not look at tensor values (other than through `w.tied`): under
export they see indices; tensors HF recomputes and leaves out of its files (`_keys_to_ignore_on_save`,
like Marian's position tables) are hidden from them. Tensors HF keeps but derives from others (MiniMax's decays from its slopes) come from the
family's `Converter.derived`, computed as HF computes them. Tensors are written in float32; ModelConfig fields that do not change the
function (`ModelConfig.execution`, dropout) are not compared. Memory: the
placeholder indices and the flat HF vector take about 9 bytes per parameter (13 past 2**31) on top
of the params, plus the verifying import.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from typing import Dict, Optional

import flax.linen as nn
import jax
import numpy as np

from tfm.config import REGULARISATION, ExecutionConfig, ModelConfig
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights
from tfm.convert.importer import from_hf
from tfm.convert.registry import CONVERTERS

__all__ = ["to_hf"]

# ---- export -------------------------------------------------------------------------------

def to_hf(config: ModelConfig, params, directory, *, architecture: Optional[str] = None,
          verify: bool = True) -> str:
    """Writes `params` of a tfm model as a Hugging Face checkpoint directory.

    config: the tfm ModelConfig of `params`.
    params: the param tree (`from_hf`'s, or `model.init(...)["params"]`, boxed or not).
    directory: created if missing; gets config.json, model.safetensors (and generation_config.json
      for generative classes).
    architecture: the HF class to write (e.g. "LlamaForCausalLM"); None = the first class in
      `CONVERTERS` order whose config reproduces `config` (a Llama config may also be a Mistral one).
    verify: import the written directory again and require the same config and bit-identical params.
    Returns the directory.
    """
    params = jax.tree.map(np.asarray, nn.meta.unbox(params))
    arch, converter, hf_cfg = _resolve(config, architecture)
    model = _meta_model(arch, hf_cfg)
    tensors = _hf_tensors(arch, converter, config, params, model)
    import torch  # torch and transformers are optional (the "test" extra): imported when exporting
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    for alias, owner in _tied_groups(model).items():  # one tensor object, so save_pretrained drops copies
        if alias not in tensors or owner not in tensors:
            continue
        if not np.array_equal(tensors[alias], tensors[owner]):
            raise ConversionError(f"{arch}: {alias} must equal {owner}, which HF ties to it, but tfm's differ")
        state[alias] = state[owner]
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, state_dict=state)
    if verify:
        _verify(directory, arch, config, params)
    return directory


def _resolve(config: ModelConfig, architecture: Optional[str]):
    """(architecture, Converter, transformers config) whose import reproduces `config`."""
    writable = {a: c for a, c in CONVERTERS.items() if c.hf_config is not None}
    if architecture is not None:
        if architecture not in writable:
            raise ConversionError(f"to_hf: architecture {architecture!r} has no config writer; "
                                  f"tfm exports {sorted(writable)}")
        return (architecture, writable[architecture], _hf_config(architecture, writable[architecture], config))
    reasons = []
    for arch, converter in writable.items():  # the writers' dicts first: no transformers imports
        try:
            _check_round_trip(arch, converter, config, _written(arch, converter, config))
        except ValueError as e:
            reasons.append(str(e))
            continue
        return arch, converter, _hf_config(arch, converter, config)
    raise ConversionError("to_hf: no Hugging Face class expresses this config:\n  " + "\n  ".join(reasons))


def _written(arch: str, converter: Converter, config: ModelConfig) -> dict:
    try:
        return dict(converter.hf_config(config))
    except ConversionError as e:
        raise ConversionError(f"{arch} cannot express this tfm config: {e}") from None


def _hf_config(arch: str, converter: Converter, config: ModelConfig):
    """The family's transformers config for `config`; refuses when importing it would not give `config` back."""
    import transformers
    fields = _written(arch, converter, config)
    hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf_cfg.architectures = [arch]
    _check_round_trip(arch, converter, config, json.loads(hf_cfg.to_json_string(use_diff=True)))
    return hf_cfg


def _check_round_trip(arch: str, converter: Converter, config: ModelConfig, fields: dict):
    """Importing the HF config `fields` must give `config` back (up to `_canonical`)."""
    try:
        back = converter.config(HFConfig(fields, arch))
    except ConversionError as e:
        raise ConversionError(f"{arch} cannot express this tfm config: {e}") from None
    want, got = _flat_fields(_canonical(config)), _flat_fields(_canonical(back))
    diff = [f"{name}={want[name]!r} (a {arch} config gives {got[name]!r})" for name in want if want[name] != got[name]]
    if diff:
        raise ConversionError(f"{arch} cannot express this tfm config: " + ", ".join(diff))


def _flat_fields(cfg: ModelConfig) -> dict:
    """{field: value} of a ModelConfig, RoPE's as rope.theta, ... and execution's as execution.moe_impl, ...
    (so a refusal names one)."""
    groups = ("rope", "execution")
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in groups}
    for group in groups:
        out.update({f"{group}.{f.name}": getattr(getattr(cfg, group), f.name)
                    for f in dataclasses.fields(getattr(cfg, group))})
    return out


def _canonical(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the fields that do not change the function reset: the execution settings (derived
    fields are always set) and the regularisation. An expert capacity (execution.capacity_factor)
    drops tokens, which HF's dropless MoE layers never do: it is kept, so the comparison refuses it."""
    capacity = cfg.execution.capacity_factor
    execution = ExecutionConfig() if capacity is None else ExecutionConfig(moe_impl="einsum", capacity_factor=capacity)
    return cfg.replace(execution=execution, **{f: ModelConfig.__dataclass_fields__[f].default for f in REGULARISATION})


def _meta_model(arch: str, hf_cfg):
    """The HF model on torch's meta device: names, shapes and ties, no memory."""
    import torch
    import transformers
    with torch.device("meta"):
        return getattr(transformers, arch)(hf_cfg)


def _tied_groups(model) -> Dict[str, str]:
    """{state-dict name: the first name of the same tensor} for tensors HF ties."""
    first, aliases = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
    return aliases


class _Recorder(Weights):
    """Weights whose tensors hold their elements' global indices; records `tied` aliases."""

    def __init__(self, shapes: Dict[str, tuple], arch: str):
        sizes = [int(np.prod(s)) for s in shapes.values()]
        self.offsets = dict(zip(shapes, np.cumsum([0] + sizes[:-1]).tolist()))
        self.total = int(sum(sizes))
        index = np.arange(self.total, dtype=np.int32 if self.total < 2 ** 31 else np.int64)
        super().__init__({k: index[o:o + int(np.prod(s))].reshape(s) for (k, s), o
                          in zip(shapes.items(), self.offsets.values())}, f"{arch} export")
        self.index_dtype = index.dtype
        self.aliases: Dict[str, np.ndarray] = {}

    def tied(self, key: str, reference: np.ndarray, field: str):
        if self.has(key):
            self(key)
            self.aliases[key] = np.asarray(reference)


def _hf_tensors(arch: str, converter: Converter, config: ModelConfig, params, model) -> Dict[str, np.ndarray]:
    """Every tensor of `model`'s state dict (less `_keys_to_ignore_on_save`), from tfm params."""
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in skip}
    pending = {k: shapes.pop(k) for k in list(shapes)  # derived by the family, not from tfm params
               if converter.derived and any(fnmatch.fnmatch(k, g) for g in converter.ignore)}
    rec = _Recorder(shapes, arch)
    index_tree = converter.params(rec, config)

    indices, values = _flat(index_tree), _flat(params)
    if {k: np.shape(v) for k, v in indices.items()} != {k: np.shape(v) for k, v in values.items()}:
        missing, extra = sorted(set(indices) - set(values)), sorted(set(values) - set(indices))
        wrong = sorted(k for k in set(indices) & set(values) if np.shape(indices[k]) != np.shape(values[k]))
        raise ConversionError(f"{arch}: params do not fit the config: missing {missing}, unexpected {extra}, "
                              f"wrong shapes {wrong}")
    flat_hf = np.zeros(rec.total, np.float32)
    written = np.zeros(rec.total, bool)
    for key, idx in indices.items():
        if idx.dtype != rec.index_dtype:
            raise ConversionError(f"{arch}: the importer computes {key} with arithmetic ({idx.dtype}); export "
                                  f"inverts layout changes only")
        idx, val = idx.ravel(), np.asarray(values[key], np.float32).ravel()
        seen = written[idx]
        if seen.any() and not np.array_equal(flat_hf[idx[seen]], val[seen]):
            raise ConversionError(f"{arch}: {key} holds HF elements that another param holds with other values")
        flat_hf[idx], written[idx] = val, True

    out = {}
    for key, shape in shapes.items():
        if key in rec.aliases:
            idx = rec.aliases[key]
            if idx.shape != shape:
                raise ConversionError(f"{arch}: {key} {shape} is tied to a tensor of shape {idx.shape}")
            if not written[idx].all():
                raise ConversionError(f"{arch}: {key} is tied to HF elements no tfm param holds")
            out[key] = flat_hf[idx]
            continue
        start, size = rec.offsets[key], int(np.prod(shape))
        done = written[start:start + size]
        if not done.all():
            what = "does not read it" if key not in rec.used else f"leaves {int((~done).sum())} element(s) unset"
            raise ConversionError(f"{arch}: cannot export HF tensor {key!r}: the importer {what}")
        out[key] = flat_hf[start:start + size].reshape(shape)
    if pending:
        extra = {k: np.asarray(v, np.float32) for k, v in converter.derived(model.config, out).items()}
        wrong = sorted(k for k, shape in pending.items() if k not in extra or extra[k].shape != shape)
        if wrong or set(extra) - set(pending):
            raise ConversionError(f"{arch}: the derived tensors {wrong or sorted(set(extra) - set(pending))} are missing, "
                                  f"misshapen or not HF's")
        out.update(extra)
    return out


def _verify(directory: str, arch: str, config: ModelConfig, params):
    """Importing `directory` again must give `config` (up to `_canonical`) and identical params."""
    back_config, back_params, _ = from_hf(directory, architecture=arch, scan_layers=config.execution.scan_layers)
    if _canonical(back_config) != _canonical(config):
        raise ConversionError(f"to_hf: {directory} imports as a different config: {back_config}")
    want, got = _flat(params), _flat(back_params)
    bad = sorted(k for k in want if k not in got or not np.array_equal(np.asarray(want[k], np.float32), got[k]))
    if bad or set(got) != set(want):
        raise ConversionError(f"to_hf: {directory} does not import back to the same params: {bad[:8]}")


def _flat(tree) -> Dict[str, np.ndarray]:
    """{key path: leaf as numpy} of a param tree."""
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
