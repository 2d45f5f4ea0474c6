"""Llama 3.2 Vision (Hugging Face's Mllama) from tfm's blocks, against transformers (PyTorch, CPU, fp32).

Text side: a DecoderLM whose layers at config.multimodal.cross_attention_layers are gated
cross-attention layers, against MllamaForCausalLM given image features (import from the live model
and from save_pretrained, export); zero gates leave the plain text decoder; cached decoding equals
the full forward. Tolerance: max-abs 1e-4 against HF, 1e-5 between tfm paths.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")
mm = pytest.importorskip("transformers.models.mllama.modeling_mllama")

from tfm import decode  # noqa: E402
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


def randomize(model, seed=0):
    """Every parameter perturbed, gates included (HF initialises them to zero, which would hide the
    cross-attention layers entirely)."""
    gen = torch.Generator().manual_seed(seed)
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
def hf_text(tmp_path_factory):
    model = randomize(tr.MllamaForCausalLM(text_config(attn_implementation="eager")))
    path = tmp_path_factory.mktemp("mllama_text")
    model.save_pretrained(path)
    return model, str(path)


@pytest.mark.parametrize("source", ["model", "dir"])
def test_text_model_matches_mllama_for_causal_lm(hf_text, source):
    hf, path = hf_text
    cfg, params, model = from_hf(hf if source == "model" else path)
    assert cfg.multimodal.cross_attention_layers == CROSS and cfg.multimodal.extra_tokens == 8
    ids, memory, tiles = inputs(1)
    with_images = max_abs(tfm_logits(model, params, ids, memory, tiles), hf_logits(hf, ids, memory, tiles))
    text_only = max_abs(tfm_logits(model, params, ids), hf_logits(hf, ids))  # HF skips the cross layers
    print(f"{source}: max-abs with images {with_images:.2e}, text only {text_only:.2e}")
    assert with_images < TOL and text_only < TOL


def test_text_model_exports_to_mllama_for_causal_lm(tmp_path):
    cfg = tfm_config()
    model, params = DecoderLM(cfg), perturbed(init(cfg))
    directory = to_hf(cfg, params, tmp_path / "mllama_text", architecture="MllamaForCausalLM")  # verifies the round trip
    hf = tr.MllamaForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    ids, memory, tiles = inputs(2)
    diff = max_abs(tfm_logits(model, params, ids, memory, tiles), hf_logits(hf, ids, memory, tiles))
    print(f"export: HF vs tfm max-abs {diff:.2e}")
    assert diff < TOL


def test_zero_gates_leave_the_plain_text_decoder():
    """At init (gates 0) the cross-attention layers add exactly nothing: the model with images equals the
    plain decoder made of its self-attention layers; a nonzero gate changes it."""
    cfg = tfm_config(extra_tokens=0)
    ids, memory, tiles = inputs(3)
    ids = ids % V
    params = init(cfg)
    assert all(float(params["decoder"][f"layer_{i}"][g]) == 0.0 for i in CROSS for g in ("cross_gate", "ffn_gate"))
    plain_cfg = cfg.replace(num_layers=4 - len(CROSS), multimodal=None)
    self_layers = [i for i in range(4) if i not in CROSS]
    plain = {**params, "decoder": {"final_norm": params["decoder"]["final_norm"],
                                   **{f"layer_{j}": params["decoder"][f"layer_{i}"] for j, i in enumerate(self_layers)}}}
    want = tfm_logits(DecoderLM(plain_cfg), plain, ids)
    np.testing.assert_array_equal(tfm_logits(DecoderLM(cfg), params, ids, memory, tiles), want)
    opened = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.5 if "gate" in jax.tree_util.keystr(path) else x, params)
    assert max_abs(tfm_logits(DecoderLM(cfg), opened, ids, memory, tiles), want) > 1e-3


def test_cached_decoding_projects_the_images_once_and_equals_the_full_forward():
    cfg = tfm_config()
    model, params = DecoderLM(cfg), perturbed(init(cfg))
    ids, memory, tiles = inputs(4)
    mask = jnp.asarray(tiles.reshape(B, T, -1))
    full = tfm_logits(model, params, ids, memory, tiles)
    cache = decode.init_cache(model, params, B, T, encoded=jnp.asarray(memory))
    cross = cache["decoder"][f"layer_{CROSS[0]}"]["cross_attn"]
    assert nn.meta.unbox(cross["cached_key"]).shape == (B, cfg.num_kv_heads, S, cfg.head_dim)
    step = jax.jit(lambda cache, tokens, mask: model.apply({"params": params, "cache": cache}, tokens,
                                                          memory_mask=mask, decode=True, mutable=["cache"]))
    steps, start = [], 0
    for stop in (3, 4, 5, 6, 7):  # a 3-token prompt, then one token at a time, without the memory
        out, state = step(cache, jnp.asarray(ids[:, start:stop]), mask[:, start:stop])
        cache, start = state["cache"], stop
        steps.append(np.asarray(out.logits))
    diff = max_abs(np.concatenate(steps, axis=1), full)
    print(f"cached vs full max-abs {diff:.2e}")
    assert diff < 1e-5


def tfm_config(extra_tokens=8):
    return ModelConfig(vocab_size=V, d_model=D, num_heads=4, num_kv_heads=2, num_layers=4, d_ff=48, max_len=64,
                       norm="rmsnorm", norm_eps=1e-5, position="rope", activation="swiglu", attention_bias=False,
                       ffn_bias=False, tie_embeddings=False, rope=dict(theta=10000.0),
                       multimodal=dict(cross_attention_layers=CROSS, extra_tokens=extra_tokens))


def init(cfg):
    return nn.meta.unbox(DecoderLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])


def perturbed(params, scale=0.3):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


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
    hf = randomize(tr.MllamaVisionModel(tr.MllamaVisionConfig(attn_implementation="eager", **VISION)))
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
