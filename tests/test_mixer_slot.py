"""The Block's one mixer slot (tfm.layers.slot): a parallel composite "attention+mamba2" equals the sum of
its branches run as single-mixer Blocks on the same parameters (multipliers included), in the forward
and in a decode continued from the cache; a linear mixer in a parallel block equals x + mix(n x) +
ffn(n x) by parts; a mixer registered by a module outside tfm (a toy token shift) is a pattern kind
with no edit to tfm; bad composites, multipliers and causal mixers in an encoder fail in one line.
fp32, tolerances 1e-5 of O(1) activations."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_zoo_recurrent import decode_in_steps
from tfm import config
from tfm.layers import slot
from tfm.layers.block import Block
from tfm.layers.inputs import BlockInputs
from tfm.models import DecoderLM
from tfm.models.presets import tiny

B, T, D = 2, 8, 32
MAMBA2 = dict(state_size=4, head_dim=8, groups=1)
SEG = jnp.asarray([[1] * 5 + [2] * 3, [1] * 6 + [0] * 2])
POS = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 0]])


def _cfg(**kw):
    kw = {"num_layers": 1, **kw, "mamba2": {**MAMBA2, **kw.get("mamba2", {})}}
    return tiny("llama", d_model=D, num_kv_heads=2, mixer_chunk_size=4, **kw)


def _block(cfg, x, params=None, decode=False):
    """A causal Block's output on x (params drawn at init unless given) and its params."""
    block = Block(cfg, causal=True, decode=decode)
    inputs = BlockInputs(segment_ids=SEG, positions=POS)
    if params is None:
        params = nn.meta.unbox(block.init(jax.random.PRNGKey(1), x, inputs))["params"]
        params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params)
    return block.apply({"params": params}, x, inputs)[0], params


def _x(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))


def test_parallel_composite_is_the_sum_of_its_branches():
    x = _x()
    scales = (("attention", 0.5, 2.0), ("mamba2", 1.5, 0.25))
    both, p = _block(_cfg(mixer_pattern=("attention+mamba2",), ffn_pattern=("none",), mixer_multipliers=scales), x)
    assert set(p) == {"attn_norm", "self_attn", "mixer"}
    # each branch alone: its input multiplier folded into its norm's scale (RMSNorm(x) * s * a)
    norm = lambda a: {"scale": p["attn_norm"]["scale"] * a}
    attn, _ = _block(_cfg(ffn_pattern=("none",)), x, {"attn_norm": norm(0.5), "self_attn": p["self_attn"]})
    mamba, _ = _block(_cfg(mixer_pattern=("mamba2",), ffn_pattern=("none",)), x,
                      {"mixer_norm": norm(1.5), "mixer": p["mixer"]})
    want = x + 2.0 * (attn - x) + 0.25 * (mamba - x)
    np.testing.assert_allclose(both, want, atol=1e-5)
    assert float(jnp.max(jnp.abs(mamba - x))) > 0.1 and float(jnp.max(jnp.abs(attn - x))) > 0.1


def test_linear_mixer_in_a_parallel_block():
    x = _x(1)
    cfg = _cfg(mixer_pattern=("mamba2",), parallel_block=True)
    out, p = _block(cfg, x)
    mix, _ = _block(_cfg(mixer_pattern=("mamba2",), ffn_pattern=("none",)), x,
                    {"mixer_norm": p["attn_norm"], "mixer": p["mixer"]})
    ffn, _ = _block(_cfg(mixer_pattern=("none",)), x, {"ffn_norm": p["attn_norm"], "ffn": p["ffn"]})
    np.testing.assert_allclose(out, x + (mix - x) + (ffn - x), atol=1e-5)


def test_composite_decodes_as_its_full_forward():
    cfg = _cfg(num_layers=2, mixer_pattern=("attention+mamba2", "mamba2"),
               mixer_multipliers=(("attention", 1.0, 0.5),))
    model = DecoderLM(cfg)
    ids = jax.random.randint(jax.random.PRNGKey(3), (B, T), 1, cfg.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), ids))["params"]
    full = model.apply({"params": params}, ids).logits
    np.testing.assert_allclose(decode_in_steps(model, params, ids, 5), full, atol=1e-5)  # chunked, then steps

class Shift(slot.TokenMixer):
    """A toy mixer registered from outside tfm: y_t = w * x_{t-1} (within a sequence), x [B, T, D]."""

    @nn.compact
    def __call__(self, x, inputs, deterministic=True, decode=False):
        w = self.param("w", nn.initializers.ones, (x.shape[-1],))
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        same = jnp.pad(inputs.segment_ids, ((0, 0), (1, 0)))[:, :-1] == inputs.segment_ids
        return jnp.where(same[..., None], prev, 0.0) * w


def test_a_mixer_registered_outside_tfm_is_a_pattern_kind(monkeypatch):
    slot.kinds()
    monkeypatch.setattr(slot, "_MIXERS", dict(slot._MIXERS))  # the registration ends with the test
    monkeypatch.setitem(config._KINDS, "mixer", list(config._KINDS["mixer"]))
    slot.register_mixer("toy_shift", Shift)
    x = _x(2)
    cfg = _cfg(mixer_pattern=("toy_shift",), ffn_pattern=("none",))
    out, p = _block(cfg, x)
    norm = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * p["mixer_norm"]["scale"]
    shifted = jnp.pad(norm, ((0, 0), (1, 0), (0, 0)))[:, :-1] * p["mixer"]["w"]
    same = (jnp.pad(SEG, ((0, 0), (1, 0)))[:, :-1] == SEG)[..., None]
    np.testing.assert_allclose(out, x + jnp.where(same, shifted, 0.0), atol=1e-5)
    with pytest.raises(ValueError, match="taken"):
        slot.register_mixer("toy_shift", Shift)


@pytest.mark.parametrize("kw,match", [
    (dict(mixer_pattern=("attention+none",)), "distinct mixers"),
    (dict(mixer_pattern=("mamba2+mamba2",)), "distinct mixers"),
    (dict(mixer_pattern=("attention+mamba3",)), r"unknown kinds \['mamba3'\]"),
    (dict(mixer_pattern=("mamba2",), mixer_multipliers=(("attention", 1.0, 2.0),)), r"names \['attention'\]"),
    (dict(mixer_pattern=("mamba2",), skip_multipliers=(("lightning", 0.5),)), r"\['lightning'\] unused"),
    (dict(skip_multipliers=(("ffn", 0.0),)), "multiplier > 0"),
    (dict(skip_multipliers=(("ffn", 0.5),), parallel_block=True), "a parallel block has one"),
    (dict(num_experts=4, ffn_multipliers=(2.0, 1.0)), "experts of num_experts=4 do not read it"),
    (dict(mamba2=dict(gate_norm="after")), "gate_norm='after' must be one of"),
    (dict(mamba2=dict(head_dim=8, inner=20)), "inner=20 must be a multiple of head_dim=8"),
])
def test_bad_composites_fail_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_a_causal_mixer_in_an_encoder_is_refused():
    cfg = _cfg(mixer_pattern=("mamba2",))
    with pytest.raises(ValueError, match="cannot sit in a bidirectional stack"):
        Block(cfg, causal=False).init(jax.random.PRNGKey(0), _x(), BlockInputs(segment_ids=SEG))
