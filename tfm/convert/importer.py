"""Hugging Face import: `from_hf` (see `tfm.convert`).

A transformers PyTorch model or a local checkpoint directory -> (tfm ModelConfig, params, tfm
model), through the family's `Converter` in `registry.CONVERTERS`.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import REGULARISATION, ExecutionConfig, ModelConfig
from tfm.convert.common import ConversionError, Weights
from tfm.convert.loading import from_directory, from_model
from tfm.convert.registry import CONVERTERS, SUPPORTED
from tfm.models import EncoderDecoder, VisionLanguageModel
from tfm.models.vision import TiledVisionEncoder, VisionEncoder


def from_hf(model_or_path, *, architecture: Optional[str] = None, param_dtype=jnp.float32,
            **config_overrides) -> Tuple[ModelConfig, dict, nn.Module]:
    """Converts a Hugging Face model to tfm.

    model_or_path: a transformers PyTorch model, or a directory with config.json and
      model.safetensors / pytorch_model.bin (sharded checkpoints with their index too).
    architecture: the HF class name, when config.json does not say (its `architectures`).
    param_dtype: dtype of the returned params (float32, like tfm's own init).
    config_overrides: what a checkpoint leaves to the user: `execution` (an ExecutionConfig or a dict)
      or its fields by name (dtype="bfloat16", scan_layers=True, attention_impl="chunked", ...), the
      regularisation (dropout_rate, attention_dropout) and max_len; fields that change the math are
      refused.
    Returns (config, params, model): params is a plain pytree of jnp arrays for
      `model.apply({"params": params}, ...)`.
    """
    if isinstance(model_or_path, (str, os.PathLike)):
        arch, fields, tensors, source = from_directory(model_or_path, architecture)
    else:
        arch, fields, tensors, source = from_model(model_or_path, architecture)
    if arch not in CONVERTERS:
        raise ConversionError(f"{source}: architecture {arch!r} is not supported; tfm converts {list(SUPPORTED)}")
    converter = CONVERTERS[arch]
    weights = Weights(tensors, source, converter.ignore)
    config = converter.read_config(fields, arch)
    if converter.refine is not None:
        config = converter.refine(config, weights)
    config = config.replace(**_runtime_overrides(config_overrides))
    params = converter.params(weights, config)
    weights.finish()
    params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), params)
    model = converter.model_class(config)
    _check_tree(model, config, params, source)
    return config, params, model


def _runtime_overrides(overrides: dict) -> dict:
    allowed = ("execution",) + ExecutionConfig.names() + REGULARISATION + ("max_len",)
    bad = sorted(set(overrides) - set(allowed))
    if bad:
        raise ValueError(f"from_hf cannot override {bad}: they change the converted model; "
                         f"allowed overrides are {list(allowed)}")
    return overrides


def _check_tree(model: nn.Module, config: ModelConfig, params: dict, source: str):
    """The converted tree must match the model's own parameters exactly (names and shapes)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    args = (tokens, tokens) if isinstance(model, EncoderDecoder) else (tokens,)
    if isinstance(model, VisionEncoder):
        args = (jax.ShapeDtypeStruct((1, config.image_size, config.image_size, config.num_channels), jnp.float32),)
    if isinstance(model, (TiledVisionEncoder, VisionLanguageModel)):
        vision = config.multimodal.vision or config
        X, size = vision.multimodal.max_num_tiles, vision.image_size
        args = (jax.ShapeDtypeStruct((1, 1, X, size, size, vision.num_channels), jnp.float32),
                jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1, 1, X), jnp.int32))
        if isinstance(model, VisionLanguageModel):
            args = (tokens,) + args
    init = lambda *args: nn.meta.unbox(model.init(jax.random.PRNGKey(0), *args)["params"])
    expected = jax.eval_shape(init, *args)
    flat = lambda tree: {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    want, got = flat(expected), flat(params)
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ConversionError(f"{source}: converted params do not fit {type(model).__name__}: missing {missing}, "
                              f"unexpected {extra}, wrong shapes {[(k, got[k], want[k]) for k in wrong]}")
