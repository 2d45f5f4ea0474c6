"""The one transformer block every family is built from."""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.attention import Attention
from tfm.layers.common import constrain, param_init, scaled
from tfm.layers import slot
from tfm.layers.feedforward import Mlp, MoeMlp
from tfm.layers.inputs import BlockInputs
from tfm.layers.norms import Norm


class Block(nn.Module):
    """A token mixer, optional cross-attention, feed-forward; norms as config.norm_position (pre, post, sandwich,
    post_sublayer); sequential or parallel (x + mix(norm x) + ffn(norm x), or two norms: x + mix(n1 x) + ffn(n2 x)).
    x [B, T, D] -> [B, T, D]. layer_index (the layer's place in its stack) picks the token mixer under
    config.mixer_pattern (a kind registered in tfm.layers.slot, named as registered: self-attention
    `self_attn` after `attn_norm`, the others `mixer` after `mixer_norm`; a composite "a+b" sums its
    mixers from the first one's norm; a fed entry "f>a" adds f's output, from the layer's input, to a's
    input before a's norm (Zamba's shared blocks); "none" leaves the slot empty), the attention kind under
    config.attention_pattern and the feed-forward under config.ffn_pattern ("none": no feed-forward).

    gated: tanh gates (pi/4 at init) scale the attention and feed-forward outputs (`attn_gate`,
    `ffn_gate`; Mllama's global vision layers). In a causal stack the layers at
    config.multimodal.cross_attention_layers are Mllama's gated cross-attention layers instead
    (see `_gated_cross`).

    `inputs` is a `BlockInputs` (segment ids, positions, cross-attention memory, relative table).
    Returns (x, None) so it can be scanned over layers.
    """

    config: ModelConfig
    causal: bool = False
    cross: bool = False
    layer_index: int = 0
    deterministic: bool = True
    decode: bool = False
    dense_ffn: bool = False  # a dense feed-forward in a MoE model (its first config.dense_layers layers)
    gated: bool = False

    @nn.compact
    def __call__(self, x, inputs: BlockInputs):
        cfg, deterministic, decode = self.config, self.deterministic, self.decode
        drop = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)
        position = cfg.norm_position
        seg = inputs.segment_ids
        if self.causal and self.layer_index in cfg.multimodal.cross_attention_layers:
            return constrain(self._gated_cross(x, inputs, drop), ("batch", "length", "embed")), None

        def sublayer(x, name, fn, skip=1.0, feed=None):
            """Residual around fn with its norm where config.norm_position puts it: before fn (pre), after the
            residual add (post), before fn and on its output (sandwich: `{name}_post_norm`), on fn's output only
            (post_sublayer), before fn with the normed input as the skip path (normed_residual); fn's output
            times config.residual_multiplier, the skip path times `skip`; `feed` is added to fn's input before
            its norm (pre only), not to the skip path."""
            norm = Norm(cfg, name=f"{name}_norm")
            h_in = x if feed is None else x + feed
            h_in = norm(h_in) if position in ("pre", "sandwich", "normed_residual") else h_in
            h = fn(h_in)
            if position == "sandwich":
                h = Norm(cfg, name=f"{name}_post_norm")(h)
            elif position == "post_sublayer":
                h = norm(h)
            y = drop(h)
            if self.gated:
                y = self._gate(f"{name}_gate", math.pi / 4, y.dtype) * y
            if position == "post":
                return norm(x + y)
            base = h_in if position == "normed_residual" else x
            return scaled(base, skip) + self._residual(y)

        kinds, ffn_kind = cfg.layer_mixers(self.layer_index), cfg.layer_ffn(self.layer_index, self.dense_ffn)
        mix = self._mixers(kinds, inputs)
        feed_kind = cfg.layer_feed(self.layer_index)
        feed = None if feed_kind is None else self._mixers((feed_kind,), inputs)(x)
        channel_mix = slot.ffn(ffn_kind)
        if channel_mix is not None:
            channel_mix = channel_mix(cfg, name="ffn")
            ffn = lambda h, deterministic: channel_mix(h, seg, decode)
        elif ffn_kind == "moe":
            ffn = MoeMlp(cfg, name="ffn")
        elif ffn_kind == "dense":
            ffn = Mlp(cfg.replace(d_ff=cfg.dense_d_ff) if cfg.dense_d_ff else cfg, name="ffn")
        if ffn_kind != "none" and cfg.ffn_multipliers[1] != 1.0:
            unscaled = ffn
            ffn = lambda h, deterministic: scaled(unscaled(h, deterministic), cfg.ffn_multipliers[1])
        if cfg.parallel_block:
            if self.gated:
                raise ValueError("a gated Block must be sequential (ModelConfig.parallel_block=False)")
            h = Norm(cfg, name="attn_norm")(x)
            h_ffn = Norm(cfg, name="ffn_norm")(x) if cfg.parallel_norms == 2 else h
            y = drop(ffn(h_ffn, deterministic)) if ffn_kind != "none" else 0.0
            x = x + self._residual((drop(mix(h)) if kinds else 0.0) + y)
        else:
            if kinds:
                x = sublayer(x, slot.kind(kinds[0]).norm, mix, cfg.skip_scale(kinds[0]), feed)
            if self.cross:
                cross_attn = Attention(cfg, cross=True, name="cross_attn")
                x = sublayer(x, "cross", lambda h: cross_attn(
                    h, inputs.memory, q_segment_ids=seg, kv_segment_ids=inputs.memory_segment_ids,
                    deterministic=deterministic, decode=decode))
            if ffn_kind != "none":
                x = sublayer(x, "ffn", lambda h: ffn(h, deterministic), cfg.skip_scale("ffn"))
        return constrain(x, ("batch", "length", "embed")), None

    def _gated_cross(self, x, inputs: BlockInputs, drop):
        """x + tanh(a) * cross_attn(n1 x), then + tanh(b) * ffn(n2 x): no self-attention, q/k norms on the
        cross-attention, gates a and b zero at init (Llama 3.2 Vision). A query whose memory_mask row
        is all False attends to the whole memory and its feed-forward output is zeroed (as HF's Mllama).
        Without memory (and no cached one) the layer is the identity, as HF skips it for text alone."""
        cfg = self.config
        cached = "cross_attn" in self.variables.get("cache", {})
        if inputs.memory is None and not cached and not self.is_initializing():
            return x
        memory = inputs.memory
        if memory is None and not cached:  # init: the params only
            memory = jnp.zeros((x.shape[0], 1, cfg.d_model), x.dtype)
        gate = lambda name: self._gate(name, 0.0, x.dtype)
        mask, seen = inputs.memory_mask, None
        if mask is not None:
            seen = mask.astype(bool).any(-1)  # [B, T]
            mask = mask.astype(bool) | ~seen[..., None]
        attn = Attention(self.config, cross=True, qk_norm=True, name="cross_attn")
        h = attn(Norm(cfg, name="cross_norm")(x), memory, kv_mask=mask, deterministic=self.deterministic,
                 decode=self.decode)
        x = x + gate("cross_gate") * drop(h)
        h = (MoeMlp if cfg.num_experts else Mlp)(cfg, name="ffn")(Norm(cfg, name="ffn_norm")(x), self.deterministic)
        if seen is not None:
            h = h * seen[..., None].astype(h.dtype)
        return x + gate("ffn_gate") * drop(h)

    def _mixers(self, kinds, inputs: BlockInputs):
        """The layer's token mixers (tfm.layers.slot), each named as registered (a composite's later branch
        whose name is taken: its kind), as one function h [B, T, D] -> sum over them of
        out * mixer(in * h) (in, out: config.mixer_scales of its kind)."""
        cfg, branches = self.config, []
        for kind in kinds:
            spec = slot.kind(kind)
            if not (self.causal or spec.bidirectional):
                raise ValueError(f"ModelConfig.mixer_pattern: a {kind!r} layer is causal; it cannot sit in a "
                                 f"bidirectional stack (an encoder)")
            name = kind if spec.name in [m.name for m, _ in branches] else spec.name
            branches.append((spec.module(cfg, causal=self.causal, layer_index=self.layer_index, name=name),
                             cfg.mixer_scales(kind)))

        def mix(h):
            out = 0.0
            for module, (scale_in, scale_out) in branches:
                out = out + scaled(module(scaled(h, scale_in), inputs, self.deterministic, self.decode), scale_out)
            return out
        return mix

    def _residual(self, y):
        """A sublayer's output as added to the residual stream: times config.residual_multiplier."""
        return scaled(y, self.config.residual_multiplier)

    def _gate(self, name: str, init: float, dtype):
        """tanh of the scalar parameter `name` (initialised to `init`)."""
        g = self.param(name, param_init(nn.initializers.constant(init), ()), (), jnp.float32)
        return jnp.tanh(g).astype(dtype)
