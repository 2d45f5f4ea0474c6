"""Every model family (decoder, encoder, encoder-decoder) trains 3 SGD steps with
attention_impl="pallas" (interpreted on CPU) with the same losses as attention_impl="xla":
fp32, max-abs <= 1e-5 per step. One layer each keeps the interpreter quick; the configs
cover MHA, GQA, MQA, packed and padded segments, windows, soft-cap, ALiBi and cross-attention."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tfm.models import DecoderLM, EncoderDecoder, EncoderModel, presets

SEGMENTS = jnp.array([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3])  # packed row; padded row, [2, 12]


def _tokens(shape, seed):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, 64)


def _decoder(cfg):
    x = _tokens((2, 12), 1)
    model = DecoderLM(cfg)
    apply = lambda p, x: model.apply({"params": p}, x, segment_ids=SEGMENTS).logits
    return model, (x,), apply, x


def _encoder(cfg):
    x = _tokens((2, 12), 2)
    model = EncoderModel(cfg)
    apply = lambda p, x: model.apply({"params": p}, x, segment_ids=SEGMENTS).mlm_logits
    return model, (x,), apply, x


def _encoder_decoder(cfg):
    src, tgt = _tokens((2, 12), 3), _tokens((2, 9), 4)
    model = EncoderDecoder(cfg)
    apply = lambda p, src, tgt: model.apply({"params": p}, src, tgt, inputs_segment_ids=SEGMENTS).logits
    return model, (src, tgt), apply, tgt


FAMILIES = {
    "gpt2": (_decoder, presets.tiny("decoder")),
    "llama_gqa_window_softcap": (_decoder, presets.tiny("llama", sliding_window=5, attn_logit_softcap=3.0)),
    "mqa_alibi": (_decoder, presets.tiny("decoder", num_kv_heads=1, position="alibi")),
    "bert": (_encoder, presets.tiny("encoder")),
    "encoder_decoder": (_encoder_decoder, presets.tiny("encdec", num_kv_heads=2)),
}


def _train_losses(build, cfg, impl: str, steps: int = 3):
    model, inputs, apply, targets = build(cfg.replace(attention_impl=impl, num_layers=1))
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), *inputs)["params"])
    tx = optax.sgd(0.5)

    def loss_fn(p, inputs, targets):
        logits = apply(p, *inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(p, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(p, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, inputs, targets)
        losses.append(float(loss))
    return np.array(losses)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_pallas_training_matches_xla(name):
    build, cfg = FAMILIES[name]
    assert cfg.execution.dtype == "float32"
    xla, pallas = _train_losses(build, cfg, "xla"), _train_losses(build, cfg, "pallas")
    assert np.all(np.isfinite(pallas)) and xla[-1] < xla[0]  # it trains
    np.testing.assert_allclose(pallas, xla, rtol=0, atol=1e-5)
