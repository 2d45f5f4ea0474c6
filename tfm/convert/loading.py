"""Reading a Hugging Face model: a live transformers (PyTorch) model, or a local checkpoint
directory (config.json + model.safetensors / pytorch_model.bin, sharded or not).

Both give (architecture name, config dict, {tensor name: float32 numpy array}, source label).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import numpy as np
from safetensors import safe_open

from tfm.convert.common import ConversionError

Source = Tuple[str, dict, Dict[str, np.ndarray], str]


def _to_numpy(tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point():
        tensor = tensor.float()  # bf16/fp16 -> fp32: tfm params are float32
    return tensor.numpy()


def from_model(model, architecture: Optional[str] = None) -> Source:
    """A transformers PreTrainedModel (PyTorch)."""
    if not hasattr(model, "state_dict") or not hasattr(model, "config"):
        raise TypeError(f"expected a transformers PyTorch model or a checkpoint directory, got {type(model)!r}")
    arch = architecture or type(model).__name__
    tensors = {k: _to_numpy(v) for k, v in model.state_dict().items()}
    return arch, model.config.to_dict(), tensors, f"{arch} model"


def from_directory(path, architecture: Optional[str] = None) -> Source:
    """A directory written by `save_pretrained` (or downloaded from the Hub)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint directory {path!r} does not exist")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path!r} is not a Hugging Face checkpoint: config.json is missing")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{config_file} is not valid JSON: {e}") from e
    if architecture is None:
        archs = config.get("architectures") or []
        if len(archs) != 1:
            raise ConversionError(f"{config_file}: 'architectures'={archs!r} does not name one model class; "
                                  f"pass architecture=... explicitly")
        architecture = archs[0]
    return architecture, config, _read_tensors(path), path


def _read_tensors(path: str) -> Dict[str, np.ndarray]:
    candidates = ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                  "pytorch_model.bin.index.json"]
    for name in candidates:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".index.json"):
            try:
                with open(file) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
                raise ConversionError(f"{file} is not a valid shard index: {e!r}") from e
            tensors = {}
            for shard in shards:
                shard_file = os.path.join(path, shard)
                if not os.path.isfile(shard_file):
                    raise FileNotFoundError(f"{file} names shard {shard!r}, which is missing")
                tensors.update(_read_file(shard_file))
            return tensors
        return _read_file(file)
    raise FileNotFoundError(f"{path!r} holds no weights: expected one of {candidates}")


def _read_file(file: str) -> Dict[str, np.ndarray]:
    try:
        if file.endswith(".safetensors"):
            return _read_safetensors(file)
        import torch  # optional (the "test" extra): only pytorch_model.bin files need it
        state = torch.load(file, map_location="cpu", weights_only=True)
        return {k: _to_numpy(v) for k, v in state.items()}
    except (FileNotFoundError, ImportError):
        raise
    except Exception as e:  # safetensors/torch raise assorted types for truncated or garbled files
        raise ConversionError(f"could not read weights file {file} (corrupt or truncated?): {e}") from e


def _read_safetensors(file: str) -> Dict[str, np.ndarray]:
    try:
        import torch  # noqa: F401  (reads bf16, which numpy cannot)
        framework, convert = "pt", _to_numpy
    except ImportError:
        framework, convert = "numpy", lambda x: x.astype(np.float32) if x.dtype.kind == "f" else x
    with safe_open(file, framework=framework) as f:
        return {k: convert(f.get_tensor(k)) for k in f.keys()}
