"""Every Hugging Face architecture tfm converts: {HF class name: `Converter`}.

Import (`importer.from_hf`) and export (`export.to_hf`) both read this table; the family modules
know nothing of it, so imports run one way: common <- families <- registry <- importer <- export.
"""
from __future__ import annotations

from tfm.convert import (bart, bert, bloom, deepseek_v3, distilbert, gpt2, gpt_neox, gptj, llama, longformer, mamba2,
                         marian, mistral, mixtral, mllama, mpt, openai_gpt, qwen2, qwen2_moe, qwen3, roberta, t5, vit)
from tfm.convert import bamba, nemotron_h
from tfm.convert import jamba, mamba
from tfm.convert import recurrent_gemma
from tfm.convert import rwkv
from tfm.convert import qwen3_next

# Order matters for export: with no architecture named, `to_hf` writes the first class here whose
# config reproduces the tfm config (a Llama config may also be a Mistral one).
CONVERTERS = {**bert.ARCHITECTURES, **gpt2.ARCHITECTURES, **llama.ARCHITECTURES, **mixtral.ARCHITECTURES,
              **marian.ARCHITECTURES, **openai_gpt.ARCHITECTURES, **mistral.ARCHITECTURES, **qwen2.ARCHITECTURES,
              **qwen2_moe.ARCHITECTURES, **qwen3.ARCHITECTURES, **gptj.ARCHITECTURES, **gpt_neox.ARCHITECTURES,
              **bloom.ARCHITECTURES, **mpt.ARCHITECTURES, **roberta.ARCHITECTURES, **distilbert.ARCHITECTURES,
              **vit.ARCHITECTURES, **t5.ARCHITECTURES, **bart.ARCHITECTURES, **deepseek_v3.ARCHITECTURES,
              **mllama.ARCHITECTURES, **longformer.ARCHITECTURES, **mamba2.ARCHITECTURES, **mamba.ARCHITECTURES,
              **rwkv.ARCHITECTURES}
CONVERTERS = {**recurrent_gemma.ARCHITECTURES, **CONVERTERS}  # before mllama, whose writer fails on geglu
CONVERTERS = {**jamba.ARCHITECTURES, **CONVERTERS}  # before mllama, whose writer fails without vision
CONVERTERS = {**qwen3_next.ARCHITECTURES, **CONVERTERS}  # before mllama, whose writer fails without vision
# after Mamba-2, whose configs Nemotron-H could also express (every layer "M")
CONVERTERS = {**CONVERTERS, **bamba.ARCHITECTURES, **nemotron_h.ARCHITECTURES}
SUPPORTED = tuple(sorted(CONVERTERS))
