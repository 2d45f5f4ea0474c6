"""Hugging Face import: a transformers PyTorch model or a local checkpoint directory ->
(tfm ModelConfig, params, tfm model), and back (`to_hf`, see `export`).

    config, params, model = tfm.convert.from_hf("path/to/checkpoint")   # or a live HF model
    logits = model.apply({"params": params}, tokens).logits   # model outputs: tfm.models.outputs
    tfm.convert.to_hf(config, params, "out/")   # config.json + model.safetensors for transformers

One mapping module per architecture (bert, gpt2, llama, mixtral, marian, openai_gpt, mistral,
qwen2, gptj, gpt_neox, bloom, mpt, roberta, distilbert, t5, bart, vit, mllama, longformer), each a
`Converter`;
`registry` lists them (`CONVERTERS`), `importer` holds `from_hf`, `export` `to_hf`; `common` holds
the shared layouts, param tree and error reporting, `loading` reads models and directories.
Config fields tfm cannot reproduce raise `ValueError` (`ConversionError`) naming the field;
checkpoint tensors with no tfm counterpart raise too, so nothing is dropped silently.
"""
from __future__ import annotations

from tfm.convert.common import ConversionError
from tfm.convert.export import to_hf
from tfm.convert.importer import from_hf
from tfm.convert.registry import CONVERTERS, SUPPORTED

__all__ = ["from_hf", "to_hf", "ConversionError", "SUPPORTED", "CONVERTERS"]
