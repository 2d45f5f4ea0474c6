"""Every Hugging Face architecture tfm converts: {HF class name: `Converter`}.

Import (`importer.from_hf`) and export (`export.to_hf`) both read this table; the family modules
know nothing of it, so imports run one way: common <- families <- registry <- importer <- export.
"""
from __future__ import annotations

from tfm.convert import (bamba, bart, bert, bloom, deepseek_v3, distilbert, gpt2, gpt_neox, gptj, jamba, llama,
                         longformer, mamba, mamba2, marian, mistral, mixtral, mllama, mpt, nemotron_h, openai_gpt, qwen2,
                         qwen2_moe, qwen3, qwen3_next, recurrent_gemma, roberta, rwkv, t5, vit)

# Order matters for export: with no architecture named, `to_hf` writes the first class here whose
# config reproduces the tfm config (a Llama config may also be a Mistral one; a Mamba-2 model is also a
# Nemotron-H whose every layer is "M").
CONVERTERS = {**bert.ARCHITECTURES, **gpt2.ARCHITECTURES, **llama.ARCHITECTURES, **mixtral.ARCHITECTURES,
              **marian.ARCHITECTURES, **openai_gpt.ARCHITECTURES, **mistral.ARCHITECTURES, **qwen2.ARCHITECTURES,
              **qwen2_moe.ARCHITECTURES, **qwen3.ARCHITECTURES, **gptj.ARCHITECTURES, **gpt_neox.ARCHITECTURES,
              **bloom.ARCHITECTURES, **mpt.ARCHITECTURES, **roberta.ARCHITECTURES, **distilbert.ARCHITECTURES,
              **vit.ARCHITECTURES, **t5.ARCHITECTURES, **bart.ARCHITECTURES, **deepseek_v3.ARCHITECTURES,
              **mllama.ARCHITECTURES, **longformer.ARCHITECTURES, **mamba.ARCHITECTURES, **mamba2.ARCHITECTURES,
              **rwkv.ARCHITECTURES, **jamba.ARCHITECTURES, **qwen3_next.ARCHITECTURES, **recurrent_gemma.ARCHITECTURES,
              **bamba.ARCHITECTURES, **nemotron_h.ARCHITECTURES}
SUPPORTED = tuple(sorted(CONVERTERS))
