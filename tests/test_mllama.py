"""Llama 3.2 Vision (Hugging Face's Mllama) from tfm's blocks, against transformers (PyTorch, CPU, fp32).

Text side: a DecoderLM whose layers at config.multimodal.cross_attention_layers are gated
cross-attention layers, against MllamaForCausalLM given image features (import from the live model
and from save_pretrained, export); zero gates leave the plain text decoder. Vision side:
TiledVisionEncoder against MllamaVisionModel. Both: VisionLanguageModel against
MllamaForConditionalGeneration, and its cached decoding (image keys/values projected once) against
its full forward. Tolerance: max-abs 1e-4 against HF, 3e-5 between tfm paths.
"""
import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")
mm = pytest.importorskip("transformers.models.mllama.modeling_mllama")

from tfm.config import ModelConfig  # noqa: E402
from tfm.convert import from_hf, to_hf  # noqa: E402
from tfm.models import DecoderLM  # noqa: E402

TOL = 1e-4
V, D, B, T = 96, 32, 2, 7
IMAGES, TILES, PATCHES = 1, 2, 5  # memory: IMAGES * TILES runs of PATCHES vectors
S = IMAGES * TILES * PATCHES
CROSS = (1, 3)


def text_config(**kw):
    return tr.MllamaTextConfig(vocab_size=V, hidden_size=D, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=48, cross_attention_layers=list(CROSS),
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)


def build(cls, config):
    """A random HF model (seeded) with every parameter perturbed, gates included (HF initialises them to
    zero, which would hide the cross-attention layers entirely)."""
    torch.manual_seed(0)
    model = cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def inputs(seed):
    """tokens [B, T] (image tokens past V included), memory [B, S, D], tile mask [B, T, IMAGES, TILES]
    with one text token that sees no tile."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V + 8, (B, T))
    memory = rng.normal(size=(B, S, D)).astype(np.float32)
    tiles = rng.integers(0, 2, (B, T, IMAGES, TILES))
    tiles[0, 0] = 0
    return ids, memory, tiles


def hf_logits(hf, ids, memory=None, tiles=None):
    kw = {}
    if memory is not None:
        mask, rows = mm._prepare_cross_attention_mask(torch.tensor(tiles), num_vision_tokens=PATCHES,
                                                       dtype=torch.float32)
        kw = dict(cross_attention_states=torch.tensor(memory), cross_attention_mask=mask,
                  full_text_row_masked_out_mask=rows)
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), **kw).logits.numpy()


def tfm_logits(model, params, ids, memory=None, tiles=None):
    kw = {} if memory is None else dict(memory=jnp.asarray(memory), memory_mask=jnp.asarray(tiles.reshape(B, T, -1)))
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), **kw).logits)


def max_abs(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def text_model():
    """A random MllamaForCausalLM and its import."""
    hf = build(tr.MllamaForCausalLM, text_config(attn_implementation="eager"))
    return (hf,) + from_hf(hf)


def test_text_model_matches_mllama_for_causal_lm_and_exports(text_model, tmp_path):
    """Imported from the live model and from its save_pretrained directory; exported, and the export
    run by HF. With images, and text alone (HF then skips the cross-attention layers)."""
    hf, cfg, params, model = text_model
    assert cfg.multimodal.cross_attention_layers == CROSS and cfg.multimodal.extra_tokens == 8
    hf.save_pretrained(tmp_path / "saved")
    ids, memory, tiles = inputs(1)
    want, want_text = hf_logits(hf, ids, memory, tiles), hf_logits(hf, ids)
    ours = tfm_logits(model, params, ids, memory, tiles)
    diffs = {"live images": max_abs(ours, want), "live text": max_abs(tfm_logits(model, params, ids), want_text)}
    saved_cfg, saved, _ = from_hf(tmp_path / "saved")
    assert saved_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, saved, params)
    directory = to_hf(cfg, params, tmp_path / "exported", architecture="MllamaForCausalLM")  # verifies the round trip
    exported = tr.MllamaForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    diffs["exported"] = max_abs(ours, hf_logits(exported, ids, memory, tiles))
    print(f"text: max-abs {({k: f'{v:.2e}' for k, v in diffs.items()})} (logits up to {np.abs(want).max():.1f})")
    assert max(diffs.values()) < TOL


def test_zero_gates_leave_the_plain_text_decoder(text_model):
    """With its gates at 0 (their init) a cross-attention layer adds nothing: the model with images
    equals the plain decoder made of its self-attention layers (to float rounding); open gates change it."""
    _, cfg, params, model = text_model
    ids, memory, tiles = inputs(3)
    layers = params["decoder"]
    closed = {**params, "decoder": {**layers, **{f"layer_{i}": {**layers[f"layer_{i}"], "cross_gate": 0.0 * layers[
        f"layer_{i}"]["cross_gate"], "ffn_gate": 0.0 * layers[f"layer_{i}"]["ffn_gate"]} for i in CROSS}}}
    plain_cfg = cfg.replace(num_layers=4 - len(CROSS), multimodal=dict(extra_tokens=8))
    self_layers = [i for i in range(4) if i not in CROSS]
    plain = {**params, "decoder": {"final_norm": layers["final_norm"],
                                   **{f"layer_{j}": layers[f"layer_{i}"] for j, i in enumerate(self_layers)}}}
    want = jax.jit(lambda p: DecoderLM(plain_cfg).apply({"params": p}, jnp.asarray(ids)).logits)(plain)
    run = jax.jit(lambda p: model.apply({"params": p}, jnp.asarray(ids), memory=jnp.asarray(memory),
                                        memory_mask=jnp.asarray(tiles.reshape(B, T, -1))).logits)
    diff = max_abs(run(closed), want)  # two compiled programs: equal up to float rounding
    assert diff < 1e-6, diff
    assert max_abs(run(params), want) > 1e-2


# ---- vision side ----------------------------------------------------------------------------

VISION = dict(hidden_size=16, num_hidden_layers=3, num_global_layers=2, attention_heads=2, intermediate_size=32,
              vision_output_dim=48, image_size=8, patch_size=4, max_num_tiles=2, intermediate_layers_indices=[0, 2],
              supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])  # 1 + P = 5 tokens a tile, padded to 8


def vision_inputs(seed):
    """pixel_values [B, 2 images, 2 tiles, 3, 8, 8] (HF layout), aspect_ratio_ids [B, 2] (one image
    absent), aspect_ratio_mask [B, 2, 2] (masked tiles)."""
    rng = np.random.default_rng(seed)
    pixels = rng.normal(size=(B, 2, 2, 3, 8, 8)).astype(np.float32)
    return pixels, np.array([[1, 2], [3, 0]]), np.array([[[1, 0], [1, 1]], [[1, 1], [0, 0]]])


def hf_vision(hf, pixels, ids, mask):
    with torch.no_grad():
        return hf(pixel_values=torch.tensor(pixels), aspect_ratio_ids=torch.tensor(ids),
                  aspect_ratio_mask=torch.tensor(mask)).last_hidden_state.numpy()


def tfm_vision(model, params, pixels, ids, mask):
    images = jnp.asarray(pixels.transpose(0, 1, 2, 4, 5, 3))  # channels last
    return np.asarray(model.apply({"params": params}, images, jnp.asarray(ids), jnp.asarray(mask)).hidden)


def test_vision_model_matches_mllama_vision_model_and_exports(tmp_path):
    """Import from the live model, export, and the exported checkpoint run by HF: all one function."""
    hf = build(tr.MllamaVisionModel, tr.MllamaVisionConfig(attn_implementation="eager", **VISION))
    cfg, params, model = from_hf(hf)
    assert cfg.multimodal.max_aspect_ratio_id == 3 and cfg.multimodal.intermediate_layers == (0, 2)
    pixels, ids, mask = vision_inputs(5)
    ours = tfm_vision(model, params, pixels, ids, mask)
    assert ours.shape == (B, 2, 2, 5, 48)
    imported = max_abs(ours, hf_vision(hf, pixels, ids, mask))
    directory = to_hf(cfg, params, tmp_path / "mllama_vision", architecture="MllamaVisionModel")  # round trip
    back = tr.MllamaVisionModel.from_pretrained(directory, attn_implementation="eager").eval()
    exported = max_abs(ours, hf_vision(back, pixels, ids, mask))
    print(f"vision: max-abs imported {imported:.2e}, exported {exported:.2e} (features up to {np.abs(ours).max():.1f})")
    assert imported < TOL and exported < TOL


# ---- end to end -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vision_language():
    """A random MllamaForConditionalGeneration and its import."""
    hf_cfg = tr.MllamaConfig(text_config=text_config().to_dict(), vision_config=VISION, attn_implementation="eager")
    hf = build(tr.MllamaForConditionalGeneration, hf_cfg)
    return (hf,) + from_hf(hf)


def vl_inputs(seed):
    ids, _, _ = inputs(seed)
    pixels, ar_ids, ar_mask = vision_inputs(seed)
    tiles = np.random.default_rng(seed).integers(0, 2, (B, T, 2, 2))
    tiles[0, 0] = 0
    return ids, pixels, ar_ids, ar_mask, tiles


def test_vision_language_model_matches_mllama_for_conditional_generation_and_exports(vision_language, tmp_path):
    hf, cfg, params, model = vision_language
    ids, pixels, ar_ids, ar_mask, tiles = vl_inputs(6)
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(pixels.transpose(0, 1, 2, 4, 5, 3)),
                                  jnp.asarray(ar_ids), jnp.asarray(ar_mask), jnp.asarray(tiles)).logits)

    def hf_run(hf):
        with torch.no_grad():
            return hf(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels),
                      aspect_ratio_ids=torch.tensor(ar_ids), aspect_ratio_mask=torch.tensor(ar_mask),
                      cross_attention_mask=torch.tensor(tiles)).logits.numpy()

    imported = max_abs(ours, hf_run(hf))
    directory = to_hf(cfg, params, tmp_path / "mllama", architecture="MllamaForConditionalGeneration")
    exported = max_abs(ours, hf_run(tr.MllamaForConditionalGeneration.from_pretrained(
        directory, attn_implementation="eager").eval()))
    print(f"end to end: max-abs imported {imported:.2e}, exported {exported:.2e} "
          f"(logits up to {np.abs(ours).max():.1f})")
    assert imported < TOL and exported < TOL


def test_cached_decoding_projects_the_images_once_and_equals_the_full_forward(vision_language):
    _, cfg, params, model = vision_language
    ids, pixels, ar_ids, ar_mask, tiles = vl_inputs(7)
    images = (jnp.asarray(pixels.transpose(0, 1, 2, 4, 5, 3)), jnp.asarray(ar_ids), jnp.asarray(ar_mask))
    full = np.asarray(model.apply({"params": params}, jnp.asarray(ids), *images, jnp.asarray(tiles)).logits)
    _, state = model.apply({"params": params}, jnp.zeros((B, T), jnp.int32), *images, decode=True, mutable=["cache"])
    cache = state["cache"]
    key = nn.meta.unbox(cache["text"]["decoder"][f"layer_{CROSS[0]}"]["cross_attn"]["cached_key"])
    assert key.shape == (B, cfg.num_kv_heads, 2 * 2 * 5, cfg.head_dim)  # images x tiles x (1 + patches)
    step = jax.jit(lambda cache, tokens, mask: model.apply({"params": params, "cache": cache}, tokens,
                                                          cross_attention_mask=mask, decode=True, mutable=["cache"]))
    steps, start = [], 0
    for stop in (3, 4, 5, 6, 7):  # a 3-token prompt, then one token at a time; no images after the first call
        out, state = step(cache, jnp.asarray(ids[:, start:stop]), jnp.asarray(tiles[:, start:stop]))
        cache, start = state["cache"], stop
        steps.append(np.asarray(out.logits))
    diff = max_abs(np.concatenate(steps, axis=1), full)
    print(f"cached vs full max-abs {diff:.2e}")
    assert diff < 3e-5


def test_multimodal_config_round_trips_and_refuses_what_it_cannot_build(vision_language):
    cfg = vision_language[1]
    assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg  # nested vision config too
    base = dict(vocab_size=V, d_model=D, num_heads=4, num_layers=4, d_ff=48)
    bad = {"must lie in": dict(multimodal=dict(cross_attention_layers=(4,))),
           "looped": dict(execution=dict(scan_layers=True), multimodal=dict(cross_attention_layers=(1,))),
           "tie_embeddings": dict(multimodal=dict(extra_tokens=8)),
           "set max_num_tiles": dict(multimodal=dict(num_global_layers=2)),
           "tiled vision encoder": dict(multimodal=dict(vision=dict(base, image_size=8, patch_size=4)))}
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            ModelConfig(**{**base, **fields})
    with pytest.raises(ValueError, match="no layer would read them"):
        DecoderLM(ModelConfig(**base)).apply({}, jnp.zeros((1, 2), jnp.int32), memory=jnp.zeros((1, 3, D)))
