"""The decoder zoo against Hugging Face transformers (PyTorch, CPU, fp32).

Each family: one tiny random HF model (d_model 32-48, 2 layers, vocab 100) with every parameter
perturbed, built once per module, converted from the live model and from its save_pretrained
directory; logits match within max-abs 1e-4. Then, from the same conversion: KV-cache decoding
equals the full forward (1e-5), attention_impl="pallas" (interpreted on CPU) equals "xla" (1e-5),
a sharded training run (data 4 x tensor 2) equals the single-device run (1e-5 on the loss), and
to_hf writes a directory transformers reloads bit-identically. (The pallas and sharded runs skip the llama3 and
dynamic RoPE variants, yarn stands for them.)
Parameter counts of one published size per family come from jax.eval_shape and are compared with
HF's counts for the same config (computed with torch.device("meta") and written out as numbers).
"""
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from tfm import decode  # noqa: E402
from tfm.config import ModelConfig  # noqa: E402
from tfm.convert import CONVERTERS, from_hf, to_hf  # noqa: E402
from tfm.convert.common import ConversionError, HFConfig  # noqa: E402
from tfm.layers.positions import rope_attention_factor, rope_frequencies  # noqa: E402
from tfm.models import DecoderLM  # noqa: E402
from tfm.ops.attention import alibi_slopes  # noqa: E402
from tfm.parallel import MeshConfig, make_mesh  # noqa: E402
from tfm.train import LMClassificationTask, LMTask, OptimizerConfig, TrainConfig, Trainer  # noqa: E402

TOL = 1e-4
V, B, T = 100, 2, 9
EAGER = dict(attn_implementation="eager")
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, **EAGER)

FAMILIES = {
    # post-norm, learned positions, the multiple-choice head W_y beside the tied LM head
    "gpt1": lambda: tr.OpenAIGPTDoubleHeadsModel(tr.OpenAIGPTConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=16, num_labels=1, **EAGER)),
    # GQA and a sliding window (4) shorter than the sequence
    "mistral": lambda: tr.MistralForCausalLM(tr.MistralConfig(
        **LLAMA, sliding_window=4, max_position_embeddings=64)),
    # q/k/v bias without o bias; layer 0 global, layer 1 sliding (window 3): attention_pattern
    "qwen2": lambda: tr.Qwen2ForCausalLM(tr.Qwen2Config(
        **LLAMA, use_sliding_window=True, sliding_window=3, max_window_layers=1, max_position_embeddings=64)),
    # Llama 3.1 scaling: head_dim 16 puts wavelengths below, inside and above [64/4, 64/1]
    "llama3": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA, max_position_embeddings=256, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # YaRN with its attention factor from mscale / mscale_all_dim
    "yarn": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA, max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 0.3})),
    # dynamic NTK: max_position_embeddings 8 < T = 9, so the base stretches
    "dynamic": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA, max_position_embeddings=8, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0})),
    # parallel block, one norm; interleaved rotary on 4 of 8 head dims; lm_head with bias
    "gptj": lambda: tr.GPTJForCausalLM(tr.GPTJConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, bos_token_id=1,
        eos_token_id=2, **EAGER)),
    # parallel residual with two norms, rotate-halves rotary on half of each head
    "neox": lambda: tr.GPTNeoXForCausalLM(tr.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, rotary_pct=0.5, **EAGER)),
    # ALiBi with 6 heads (not a power of two), LayerNorm on the embeddings
    "bloom": lambda: tr.BloomForCausalLM(tr.BloomConfig(vocab_size=V, hidden_size=48, n_layer=2, n_head=6, **EAGER)),
    # ALiBi with 6 heads, bias-free LayerNorms and linears
    "mpt": lambda: tr.MptForCausalLM(tr.MptConfig(vocab_size=V, d_model=48, n_layers=2, n_heads=6, max_seq_len=32,
                                                  **EAGER)),
}


def randomize(model):
    """Perturb every float parameter (tied ones once) so that zero biases and unit scales hide nothing."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def tokens(seed, shape=(B, T)):
    return np.random.default_rng(seed).integers(1, V - 1, shape)


def max_abs(a, b, mask=None):
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float(diff[np.asarray(mask, bool)].max() if mask is not None else diff.max())


# Families the compiled-graph tests (pallas, sharded training) run: the three Llama 3.x scalings
# differ only in RoPE frequencies, which neither the kernels nor the sharding rules see, so yarn
# (which also scales cos/sin) stands for them there.
GRAPH_FAMILIES = sorted(set(FAMILIES) - {"llama3", "dynamic"})
# Sharded training (one layer each to bound compile time): a family for each kind of parameter layout the
# rules must split (mistral and yarn add none to qwen2's, mpt none to bloom's, neox none to gptj's: the
# same projections and norms, with or without biases); every family's layers are tfm's own.
SHARDED_FAMILIES = ["bloom", "gpt1", "gptj", "qwen2"]

MASK = (np.arange(T)[None] < np.array([[T], [6]])).astype(np.int64)  # right padding on row 1


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = randomize(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, str(path)


def hf_logits(name, hf, ids, mask):
    with torch.no_grad():
        if name == "gpt1":  # the double-heads model takes [B, choices, T]; one choice here
            out = hf(torch.tensor(ids)[:, None], attention_mask=torch.tensor(mask),  # [B * choices, T]
                     mc_token_ids=torch.tensor([T - 1, 5])[:, None])
            return out.logits[:, 0].numpy(), out.mc_logits.numpy()
        return hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy(), None


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_logits_match_hf(family):
    name, hf, path = family
    ids = tokens(1)
    ref, ref_mc = hf_logits(name, hf, ids, MASK)
    forward = None
    for source in (hf, path):
        cfg, params, model = from_hf(source)
        forward = forward or jax.jit(functools.partial(
            model.apply, segment_ids=jnp.asarray(MASK),
            **({"cls_positions": jnp.array([T - 1, 5])} if name == "gpt1" else {})))
        out = forward({"params": params}, jnp.asarray(ids))
        diff = max_abs(out.logits, ref, MASK)
        if name == "gpt1":
            diff = max(diff, max_abs(out.cls_logits, ref_mc))
        print(f"{name} [{'model' if source is hf else 'dir'}] max-abs {diff:.2e}")
        assert diff < TOL, (name, diff)
    expected = {"gpt1": dict(norm_position="post", heads=("classification",), num_labels=1),
                "mistral": dict(sliding_window=4, attention_pattern=None, num_kv_heads=2),
                "qwen2": dict(attention_pattern=("global", "local"), sliding_window=3, attention_out_bias=False),
                "llama3": dict(rope=dict(scaling="llama3", original_max_len=64)),
                "yarn": dict(rope=dict(scaling="yarn", factor=4.0)),
                "dynamic": dict(rope=dict(scaling="dynamic", original_max_len=8)),
                "gptj": dict(rope=dict(dim=4, interleaved=True), parallel_block=True, parallel_norms=1),
                "neox": dict(rope=dict(dim=4), parallel_block=True, parallel_norms=2),
                "bloom": dict(position="alibi", embedding_norm=True, num_heads=6),
                "mpt": dict(position="alibi", norm_bias=False, attention_bias=False)}[name]
    got = lambda k, v: {f: getattr(cfg.rope, f) for f in v} if k == "rope" else getattr(cfg, k)  # rope: fields named
    assert {k: got(k, v) for k, v in expected.items()} == expected


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_kv_cache_decoding_equals_full_forward(family):
    """Token-by-token decoding on the fixed-shape cache gives the full forward's logits (1e-5).
    (dynamic NTK is stateless in tfm: with T <= max_position_embeddings it is plain RoPE, which is
    what HF's cache decoding also uses below that length.)"""
    name, hf, _ = family
    cfg, params, model = from_hf(hf)
    ids = jnp.asarray(tokens(2, (B, 8 if name == "dynamic" else T)))
    full = jax.jit(model.apply)({"params": params}, ids).logits
    step = jax.jit(decode.step_fn(model, params))
    cache = decode.init_cache(model, params, B, ids.shape[1])
    steps = []
    for t in range(ids.shape[1]):
        logits, cache = step(cache, ids[:, t:t + 1])
        steps.append(logits[:, 0])
    diff = max_abs(jnp.stack(steps, 1), full)
    assert diff < 1e-5, (name, diff)


@pytest.mark.parametrize("family", GRAPH_FAMILIES, indirect=True)
def test_pallas_equals_xla(family):
    """attention_impl="pallas" (the flash kernels, interpreted on CPU) gives xla's logits."""
    name, hf, _ = family
    _, params, model = from_hf(hf)
    _, _, pallas = from_hf(hf, attention_impl="pallas", attention_dropout=0.0)  # dropout: xla only
    ids, seg = jnp.asarray(tokens(3)), jnp.asarray(MASK)
    a = jax.jit(model.apply)({"params": params}, ids, segment_ids=seg).logits
    b = jax.jit(pallas.apply)({"params": params}, ids, segment_ids=seg).logits
    diff = max_abs(a, b, MASK)
    assert diff < 1e-5, (name, diff)


# ---- sharded training -------------------------------------------------------------------------

MESHES = {"single": (MeshConfig(data=1), "data"), "data4_tensor2": (MeshConfig(data=4, tensor=2), "data+tensor"),
          "data2_context4": (MeshConfig(data=2, context=4), "data+context")}  # name -> (mesh, rule sets)


def _train_batch(name, rng, Bt=8, Tt=16):
    y = rng.integers(1, V, (Bt, 2, Tt + 1) if name == "gpt1" else (Bt, Tt + 1)).astype(np.int32)
    batch = {"inputs": y[..., :-1], "targets": y[..., 1:], "weights": np.ones(y[..., 1:].shape, np.float32)}
    if name == "gpt1":  # two choices per example, the head reads the last token
        batch["label"] = rng.integers(0, 2, (Bt,)).astype(np.int32)
    return batch


def _losses(name, cfg, mesh_name, steps=3):
    mesh_cfg, parallelism = MESHES[mesh_name]
    task = LMClassificationTask() if name == "gpt1" else LMTask()
    batch = _train_batch(name, np.random.default_rng(0))
    train_cfg = TrainConfig(num_train_steps=steps, batch_size=8, mesh=mesh_cfg, parallelism=parallelism,
                            optimizer=OptimizerConfig(name="adam", learning_rate=5e-3))
    n = int(np.prod(mesh_cfg.ici_sizes()))
    trainer = Trainer(DecoderLM(cfg), task, train_cfg, make_mesh(mesh_cfg, jax.devices()[:n])).setup(batch)
    state, out = trainer.init_state(), []
    for _ in range(steps):
        state, m = trainer.train_step(state, trainer.global_batch(batch))
        out.append(float(m["loss"]))
    return np.array(out)


@pytest.mark.parametrize("family", SHARDED_FAMILIES, indirect=True)
def test_sharded_training_equals_single_device(family):
    """3 Adam steps on data 4 x tensor 2 give the single-device losses (fp32, 1e-5), and they fall;
    the family's converted config, cut to one layer (one period of Qwen2's pattern)."""
    name, hf, _ = family
    cfg = from_hf(hf, dropout_rate=0.0, attention_dropout=0.0)[0]  # GPT-1's dropout off: equal runs
    cfg = cfg.replace(num_layers=cfg.pattern_period)  # one layer (Qwen2: one of each kind): compile time
    ref, got = _losses(name, cfg, "single"), _losses(name, cfg, "data4_tensor2")
    assert ref[0] - ref[-1] > 0.01, (name, ref)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


# ---- parameter counts of published sizes ------------------------------------------------------

# HF's counts for the same configs: sum(p.numel()) of the model built under torch.device("meta").
PUBLISHED = {
    "gpt1": ("OpenAIGPTDoubleHeadsModel", lambda: tr.OpenAIGPTConfig(num_labels=1), 116_535_553),  # openai-gpt
    "mistral": ("MistralForCausalLM", lambda: tr.MistralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096), 7_241_732_096),  # 7B v0.1
    "qwen2": ("Qwen2ForCausalLM", lambda: tr.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768), 494_032_768),  # 0.5B
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda: tr.Qwen2MoeConfig(), 14_315_784_192),  # Qwen1.5-MoE-A2.7B
    "llama3": ("LlamaForCausalLM", lambda: tr.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), 8_030_261_248),  # 3.1 8B
    "gptj": ("GPTJForCausalLM", lambda: tr.GPTJConfig(), 6_050_882_784),  # 6B
    "neox": ("GPTNeoXForCausalLM", lambda: tr.GPTNeoXConfig(
        vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=2048, rotary_pct=0.25), 162_322_944),  # Pythia-160m
    "bloom": ("BloomForCausalLM", lambda: tr.BloomConfig(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
              559_214_592),  # bloom-560m
    "mpt": ("MptForCausalLM", lambda: tr.MptConfig(d_model=4096, n_heads=32, n_layers=32, vocab_size=50432,
                                                   max_seq_len=2048), 6_649_286_656),  # mpt-7b
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_of_published_size(name):
    arch, hf_config, expected = PUBLISHED[name]
    cfg = CONVERTERS[arch].config(HFConfig(hf_config().to_dict(), arch)).replace(scan_layers=True)
    tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda t: DecoderLM(cfg).init(jax.random.PRNGKey(0), t), tok)["params"]
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(shapes)))
    assert count == expected, (name, count, expected)


# ---- RoPE scalings against HF's rope init functions --------------------------------------------

ROPE_CASES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8,
                    "mscale_all_dim": 0.3, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn_given_factor_untruncated": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16,
                                      "attention_factor": 1.3, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_hf_init_functions(case):
    """Inverse frequencies and yarn's cos/sin factor equal HF's (fp32, rtol 1e-6); dynamic at a
    sequence of 100 positions past max_position_embeddings = 64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg = tr.LlamaConfig(**{**LLAMA, "max_position_embeddings": 64},
                            rope_parameters={"rope_theta": 500.0, **ROPE_CASES[case]})
    kind = ROPE_CASES[case]["rope_type"]
    ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", **({"seq_len": 100} if kind == "dynamic" else {}))
    cfg = CONVERTERS["LlamaForCausalLM"].config(HFConfig(hf_cfg.to_dict(), "LlamaForCausalLM"))
    got = rope_frequencies(cfg, jnp.asarray(99) if kind == "dynamic" else None)
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-6)
    assert abs(rope_attention_factor(cfg) - ref_factor) < 1e-6


# ---- ALiBi slopes: BLOOM's and MPT's code for non-powers of two ---------------------------------

@pytest.mark.parametrize("heads", [6, 12, 16])
def test_alibi_slopes_match_bloom_and_mpt(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    ones = torch.ones(1, 2)
    bloom = build_alibi_tensor(ones, heads, torch.float32)[:, 0, 1].numpy()  # slope * position 1
    mpt = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0].numpy()  # slope * (1 - 2) negated
    np.testing.assert_allclose(alibi_slopes(heads), bloom, rtol=1e-6)
    np.testing.assert_allclose(alibi_slopes(heads, 8.0), mpt, rtol=1e-6)
    mpt16 = -build_mpt_alibi_tensor(heads, 2, alibi_bias_max=16)[:, 0, 0].numpy()
    np.testing.assert_allclose(alibi_slopes(heads, 16.0), mpt16, rtol=1e-6)


# ---- GPT-1 fine-tuning objective -----------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt1"], indirect=True)
def test_gpt1_task_loss_is_hf_mc_loss_plus_lambda_lm_loss(family):
    """LMClassificationTask on [B, choices, T]: task loss = HF's mc_loss, lm loss = HF's lm_loss,
    objective = mc_loss + 0.5 * lm_loss (Radford et al. 2018, eq. 5)."""
    _, hf, _ = family
    _, params, model = from_hf(hf)
    C = 3
    ids, label = tokens(5, (B, C, T)), np.array([2, 0])
    with torch.no_grad():
        ref = hf(torch.tensor(ids), mc_token_ids=torch.full((B, C), T - 1), labels=torch.tensor(ids),
                 mc_labels=torch.tensor(label))
    weights = np.ones((B, C, T), np.float32)
    weights[..., -1] = 0  # HF scores the next token of positions 0..T-2
    batch = {"inputs": jnp.asarray(ids), "targets": jnp.asarray(np.roll(ids, -1, axis=-1)),
             "weights": jnp.asarray(weights), "label": jnp.asarray(label)}
    task = LMClassificationTask(lm_weight=0.5)
    objective, metrics = task.loss(model, params, batch, jax.random.PRNGKey(0), task.weight_totals(batch),
                                   deterministic=True)
    assert abs(float(metrics["task_loss"]) - float(ref.mc_loss)) < 1e-5
    assert abs(float(metrics["lm_loss"]) - float(ref.loss)) < 1e-5
    assert abs(float(objective) - float(ref.mc_loss + 0.5 * ref.loss)) < 1e-5


# ---- GPT-3-style alternating attention ------------------------------------------------------------

PATTERN = dict(vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, num_layers=4, position="rope",
               norm="rmsnorm", activation="swiglu", sliding_window=3)
PATTERNS = {"gpt3": ("global", "local"), "gemma2": ("local", "global"), "mistral": ("local",)}


def _brute_attention(x, p, layer_window, N=4, K=2, H=8):
    """Causal (and banded when layer_window is set) softmax attention in float64 loops, no RoPE."""
    x = np.asarray(x, np.float64)
    q = np.einsum("btd,dnh->btnh", x, p["query"]["kernel"])
    k = np.einsum("btd,dkh->btkh", x, p["key"]["kernel"])
    v = np.einsum("btd,dkh->btkh", x, p["value"]["kernel"])
    out = np.zeros_like(q)
    for b, t, n in np.ndindex(q.shape[0], q.shape[1], N):
        keys = [s for s in range(q.shape[1]) if s <= t and (layer_window is None or t - s < layer_window)]
        logits = np.array([q[b, t, n] @ k[b, s, n // (N // K)] for s in keys]) / np.sqrt(H)
        w = np.exp(logits - logits.max())
        out[b, t, n] = (w / w.sum()) @ np.stack([v[b, s, n // (N // K)] for s in keys])
    return np.einsum("btnh,nhd->btd", out, p["out"]["kernel"])


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_attention_pattern_per_layer_mask_is_brute_force(pattern):
    """Layer i attends causally within sliding_window exactly when pattern[i % P] is "local"."""
    from tfm.layers.attention import Attention
    cfg = ModelConfig(**{**PATTERN, "position": "none", "attention_bias": False},
                      attention_pattern=PATTERNS[pattern])
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 7, 32))
    for i in range(cfg.num_layers):
        attn = Attention(cfg, causal=True, layer_index=i)
        p = nn.meta.unbox(attn.init(jax.random.PRNGKey(i), x)["params"])
        window = 3 if PATTERNS[pattern][i % len(PATTERNS[pattern])] == "local" else None
        assert cfg.layer_window(i) == window
        got = attn.apply({"params": p}, x, positions=jnp.arange(7)[None])
        np.testing.assert_allclose(got, _brute_attention(x, jax.tree.map(np.asarray, p), window), atol=1e-5)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_attention_pattern_layers_equal_single_kind_models_and_scan(pattern):
    """Each layer of a patterned stack equals that layer built in a model of its one kind; the
    scanned stack (a scan over groups of P layers) gives the looped logits; cached decoding of
    the scanned GPT-3 stack equals its full forward."""
    from tfm.convert.common import stack_layers
    from tfm.layers.block import Block, BlockInputs
    cfg = ModelConfig(**PATTERN, attention_pattern=PATTERNS[pattern])
    ids = jnp.asarray(tokens(6, (B, 8)))
    model = DecoderLM(cfg)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), ids)["params"])
    x = jax.random.normal(jax.random.PRNGKey(1), (B, 8, 32))
    inputs = BlockInputs(positions=jnp.broadcast_to(jnp.arange(8), (B, 8)))
    for i in range(cfg.num_layers):
        kind = PATTERNS[pattern][i % len(PATTERNS[pattern])]
        single = cfg.replace(attention_pattern=(kind,))
        layer = {"params": params["decoder"][f"layer_{i}"]}
        a, _ = jax.jit(Block(cfg, causal=True, layer_index=i).apply)(layer, x, inputs)
        b, _ = jax.jit(Block(single, causal=True).apply)(layer, x, inputs)
        np.testing.assert_array_equal(a, b)
    looped = jax.jit(model.apply)({"params": params}, ids).logits
    scan_cfg = cfg.replace(scan_layers=True)
    layers = [params["decoder"][f"layer_{i}"] for i in range(cfg.num_layers)]
    scanned_params = {**params, "decoder": {**stack_layers(layers, True, cfg.pattern_period),
                                            "final_norm": params["decoder"]["final_norm"]}}
    scanned = DecoderLM(scan_cfg)
    np.testing.assert_allclose(jax.jit(scanned.apply)({"params": scanned_params}, ids).logits, looped, atol=1e-5)
    if pattern != "gpt3":
        return  # cached decoding through the scanned groups: once
    step = jax.jit(decode.step_fn(scanned, scanned_params))
    cache = decode.init_cache(scanned, scanned_params, B, 8)
    steps = []
    for t in range(8):
        logits, cache = step(cache, ids[:, t:t + 1])
        steps.append(logits[:, 0])
    np.testing.assert_allclose(jnp.stack(steps, 1), looped, atol=1e-5)


def test_attention_pattern_changes_the_output():
    """The pattern is not inert: alternating layers differ from all-global and all-local stacks."""
    cfg = ModelConfig(**PATTERN, attention_pattern=("global", "local"))
    ids = jnp.asarray(tokens(7, (B, 8)))
    params = nn.meta.unbox(DecoderLM(cfg).init(jax.random.PRNGKey(0), ids)["params"])
    out = {kinds: DecoderLM(cfg.replace(attention_pattern=kinds)).apply({"params": params}, ids).logits
           for kinds in [("global", "local"), ("global",), ("local",)]}
    assert max_abs(out[("global", "local")], out[("global",)]) > 1e-3
    assert max_abs(out[("global", "local")], out[("local",)]) > 1e-3


# ---- unsupported HF config fields ---------------------------------------------------------------

UNSUPPORTED = [
    ("MptForCausalLM", lambda: tr.MptConfig(attn_config={"qk_ln": True}), "attn_config.qk_ln"),
    ("MptForCausalLM", lambda: tr.MptConfig(attn_config={"clip_qkv": 6.0}), "attn_config.clip_qkv"),
    ("MptForCausalLM", lambda: tr.MptConfig(attn_config={"alibi_bias_max": 16}), "attn_config.alibi_bias_max"),
    ("MptForCausalLM", lambda: tr.MptConfig(expansion_ratio=2), "expansion_ratio"),
    ("MptForCausalLM", lambda: tr.MptConfig(logit_scale=2.0), "logit_scale"),
    ("BloomForCausalLM", lambda: tr.BloomConfig(apply_residual_connection_post_layernorm=True),
     "apply_residual_connection_post_layernorm"),
    ("LlamaForCausalLM", lambda: tr.LlamaConfig(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                                  "short_factor": [1.0], "long_factor": [1.0]}),
     "rope_type"),
    ("LlamaForCausalLM", lambda: tr.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                  "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    ("Qwen2ForCausalLM", lambda: tr.Qwen2Config(num_hidden_layers=2),
     "layer_types"),
    ("OpenAIGPTDoubleHeadsModel", lambda: tr.OpenAIGPTConfig(summary_activation="tanh"), "summary_activation"),
    ("OpenAIGPTDoubleHeadsModel", lambda: tr.OpenAIGPTConfig(summary_type="mean"), "summary_type"),
    ("GPTJForCausalLM", lambda: tr.GPTJConfig(activation_function="tanh"), "activation_function"),
    ("OpenAIGPTLMHeadModel", lambda: tr.OpenAIGPTConfig(afn="tanh"), "afn"),
]


@pytest.mark.parametrize("arch,make,field", UNSUPPORTED, ids=[f"{a}-{f}" for a, _, f in UNSUPPORTED])
def test_unsupported_config_fields_are_refused_by_name(arch, make, field):
    fields = make().to_dict()
    if arch == "Qwen2ForCausalLM":
        fields["layer_types"] = ["full_attention", "chunked"]  # HF validates its own list
    with pytest.raises(ConversionError, match=field):
        CONVERTERS[arch].config(HFConfig(fields, arch))


# ---- export ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_export_reloads_in_transformers_bit_identical(family, tmp_path):
    """from_hf -> to_hf (class chosen by to_hf; it re-imports the directory and requires the same
    config and bit-identical params) -> transformers loads it with no missing or unexpected keys
    and every tensor equal to the original model's."""
    import json
    name, hf, _ = family
    cfg, params, _ = from_hf(hf)
    directory = to_hf(cfg, params, tmp_path / name)
    with open(directory + "/config.json") as f:
        assert json.load(f)["architectures"] == [type(hf).__name__]
    reloaded, info = type(hf).from_pretrained(directory, output_loading_info=True, **EAGER)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = reloaded.state_dict()
    for key, tensor in hf.state_dict().items():
        if tensor.is_floating_point() and "inv_freq" not in key:
            assert torch.equal(state[key], tensor), key
