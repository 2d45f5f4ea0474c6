"""Vision-language model in Llama 3.2 Vision's layout (HF MllamaForConditionalGeneration): the
tiled image encoder, a linear projection of its features to the text width, and a DecoderLM whose
gated cross-attention layers read them."""
from __future__ import annotations

import flax.linen as nn

from tfm.config import REGULARISATION, ModelConfig
from tfm.layers.common import Einsum, compute_dtype
from tfm.models.decoder import DecoderLM
from tfm.models.vision import TiledVisionEncoder

class VisionLanguageModel(nn.Module):
    """tokens [B, T] and images -> `LMOutput` with logits [B, T, V] (fp32).

    config: the text decoder's ModelConfig; config.multimodal.vision the image encoder's (which runs
    with the text config's `execution` and dropout).
    images [B, I, X, H, W, C], aspect_ratio_ids [B, I], aspect_ratio_mask [B, I, X]: see
    `TiledVisionEncoder`; their features [B, I, X, L, D'] are projected to [B, I * X * L, D].
    cross_attention_mask [B, T, I, X]: which image tiles each token sees (None = all; a token that
    sees none attends to all and its cross-attention layers' feed-forward output is zeroed, as HF).
    Without images the cross-attention layers are skipped, except in decode mode once the cache
    holds the images' keys and values: make the cache with the images (`model.apply(params, dummy
    [B, L], images, aspect_ratio_ids, aspect_ratio_mask, decode=True, mutable=["cache"])`, which runs
    the image encoder once), then step without them, passing the new tokens' cross_attention_mask
    rows (None: all tiles).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, images=None, aspect_ratio_ids=None, aspect_ratio_mask=None, cross_attention_mask=None,
                 segment_ids=None, positions=None, deterministic: bool = True, decode: bool = False,
                 logits: bool = True):
        cfg = self.config
        vision_cfg = cfg.multimodal.vision
        if vision_cfg is None:
            raise ValueError("VisionLanguageModel needs ModelConfig.multimodal.vision (the image encoder's config)")
        vision_cfg = vision_cfg.replace(execution=cfg.execution, **{f: getattr(cfg, f) for f in REGULARISATION})
        memory = None
        if images is not None:
            features = TiledVisionEncoder(vision_cfg, name="vision")(images, aspect_ratio_ids, aspect_ratio_mask,
                                                                     deterministic).hidden
            F = features.shape[-1]
            memory = Einsum("BIXLF,FD->BIXLD", (F, cfg.d_model), ("mlp", "embed"), ("embed",), use_bias=True,
                            dtype=compute_dtype(cfg), name="projector")(features)
            memory = memory.reshape(memory.shape[0], -1, cfg.d_model)  # [B, I * X * L, D]
        mask = None
        if cross_attention_mask is not None:
            mask = cross_attention_mask.reshape(cross_attention_mask.shape[:2] + (-1,))  # [B, T, I * X]
        return DecoderLM(cfg, name="text")(tokens, segment_ids, positions, memory=memory, memory_mask=mask,
                                           deterministic=deterministic, decode=decode, logits=logits)
