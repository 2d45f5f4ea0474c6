"""The modules behind ModelConfig.mixer_pattern and ffn_pattern's kinds other than attention and the
dense or MoE feed-forward. Each is called as `module(config, name=...)(x [B, T, D], segment_ids, decode)`
-> [B, T, D]; the `Block` puts it in its slot."""
from __future__ import annotations

from tfm.layers.deltanet import GatedDeltaNet
from tfm.layers.mamba import Mamba, Mamba2
from tfm.layers.rglru import RecurrentBlock
from tfm.layers.rwkv import RwkvChannelMix, RwkvTimeMix

# mixer_pattern kind -> the token mixer's module (named "mixer" in its Block)
MIXER_LAYERS = {"mamba": Mamba, "mamba2": Mamba2, "gated_deltanet": GatedDeltaNet, "rwkv": RwkvTimeMix,
                "rglru": RecurrentBlock}
# ffn_pattern kind -> a feed-forward that reads more than its own token (named "ffn" in its Block)
FFN_LAYERS = {"rwkv": RwkvChannelMix}
