"""Parameter counts from `jax.eval_shape` with the formulas written out, and clear errors for
bad configurations and bad inputs."""
import ast
import dataclasses
import json
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.config import ExecutionConfig, ModelConfig, mixer_groups
from tfm.models import DecoderLM, EncoderDecoder, EncoderModel, presets

ROOT = pathlib.Path(__file__).resolve().parent.parent


def count_params(model, *inputs):
    shapes = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), *inputs)["params"]))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def bert_formula(V, D, F, L, P=512, types=2):
    embeddings = V * D + P * D + types * D + 2 * D  # word, position, type, LayerNorm
    layer = 4 * (D * D + D) + 2 * D + (D * F + F) + (F * D + D) + 2 * D  # attn, LN, FFN, LN
    pooler, nsp = D * D + D, 2 * D + 2
    mlm = (D * D + D) + 2 * D + V  # transform dense, LayerNorm, output bias (decoder tied)
    return embeddings + L * layer + pooler + nsp + mlm


def hf_bert_count(cfg):
    """BertForPreTraining built on the meta device: the parameter count without memory."""
    import torch
    from transformers import BertConfig, BertForPreTraining
    hf_cfg = BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff)
    with torch.device("meta"):
        model = BertForPreTraining(hf_cfg)
    return sum(p.numel() for p in model.parameters())  # tied decoder weight counted once


@pytest.mark.parametrize("preset, expected", [("bert_base", 110_106_428), ("bert_large", 336_226_108)])
def test_bert_parameter_counts_equal_hugging_face(preset, expected):
    cfg = getattr(presets, preset)()
    x = jnp.zeros((1, 8), jnp.int32)
    ours = count_params(EncoderModel(cfg), x)
    assert ours == bert_formula(cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.num_layers) == expected
    assert ours == hf_bert_count(cfg)


def transformer_formula(V, D, F, L):
    """One shared V x D matrix (source, target, output); sinusoidal positions have no params."""
    attention = 4 * (D * D + D)
    ffn = D * F + F + F * D + D
    encoder_layer = attention + ffn + 2 * (2 * D)
    decoder_layer = 2 * attention + ffn + 3 * (2 * D)
    return V * D + L * (encoder_layer + decoder_layer)


@pytest.mark.parametrize("preset, expected, paper", [("transformer_base", 63_082_496, 65e6),
                                                     ("transformer_big", 214_245_376, 213e6)])
def test_transformer_parameter_counts_near_paper(preset, expected, paper):
    """Vaswani et al. report 65M / 213M. With a 37,000 shared vocabulary the base model has 63.1M: the
    paper's figure is consistent with a ~41k vocabulary (it does not state the count's vocabulary);
    big lands at 214.2M (0.6% above the paper)."""
    cfg = getattr(presets, preset)()
    x = jnp.zeros((1, 8), jnp.int32)
    ours = count_params(EncoderDecoder(cfg), x, x)
    assert ours == transformer_formula(cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.num_layers) == expected
    assert abs(ours - paper) / paper < 0.035


def test_gpt2_small_and_llama_counts():
    x = jnp.zeros((1, 8), jnp.int32)
    V, D, F, L, P = 50_257, 768, 3072, 12, 1024
    gpt2 = V * D + P * D + L * (4 * (D * D + D) + (D * F + F + F * D + D) + 2 * (2 * D)) + 2 * D
    assert count_params(DecoderLM(presets.gpt2_small()), x) == gpt2 == 124_439_808  # GPT-2 "124M"
    # Llama-3-8B shape: V 128256, D 4096, 32 layers, 32 q heads, 8 kv heads, F 14336, untied
    cfg = presets.llama(vocab_size=128_256)
    D, F, K, H = 4096, 14_336, 8, 128
    layer = D * D + 2 * D * K * H + D * D + 3 * D * F + 2 * D
    assert count_params(DecoderLM(cfg), x) == 2 * 128_256 * D + 32 * layer + D == 8_030_261_248


@pytest.mark.parametrize("changes, match", [
    (dict(num_heads=5), "num_heads=5 does not divide d_model=32"),
    (dict(num_kv_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(num_kv_heads=0), "num_kv_heads must be >= 1"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not one of"),
    (dict(position="relative_key"), "position='relative_key' is not one of"),
    (dict(activation="tanh"), "activation='tanh' is not one of"),
    (dict(attention_impl="flash"), "attention_impl='flash' is not one of"),
    (dict(position="rope", head_dim=7), "even head_dim"),
    (dict(dropout_rate=1.0), "dropout_rate must be in"),
    (dict(num_experts=4, experts_per_token=5), "experts_per_token=5"),
    (dict(num_experts=4, moe_impl="sorted"), "moe_impl='sorted' is not one of"),
    (dict(num_experts=4, capacity_factor=1.25), r"capacity_factor=1.25 needs moe_impl='einsum'"),
    (dict(num_experts=4, moe_impl="einsum", moe_chunks=2), r"moe_chunks=2 must be >= 1, and > 1 needs moe_impl='ragged'"),
    (dict(num_experts=4, moe_chunks=0), r"moe_chunks=0 must be >= 1"),
    (dict(shared_expert_d_ff=16), r"shared_expert_d_ff=16 needs num_experts > 0"),
    (dict(attention_dropout=0.1, attention_impl="chunked"), "attention_dropout needs an attention backend that "
                                                                "implements dropout"),
    (dict(heads=("mlm", "qa")), "unknown"),
    (dict(pad_id=64), "pad_id=64 outside the vocabulary"),
    (dict(remat_policy="sometimes"), "remat_policy='sometimes'"),
    (dict(position="rope", rope=dict(scaling="ntk", factor=0.5)), r"rope.factor must be >= 1"),
    (dict(position="rope", rope=dict(scaling="yarn")), r"rope.scaling='yarn' needs rope.original_max_len"),
    (dict(position="rope", rope=dict(scaling="longrope")), r"rope.scaling='longrope' is not one of"),
    (dict(position="rope", rope=dict(dim=3)), r"rope.dim=3 must be even"),
    (dict(position="rope", rope=dict(dim=16)), r"rope.dim=16 must be at most head_dim=8"),
    (dict(rope=dict(thta=1.0)), r"rope has no field\(s\) \['thta'\]"),
    (dict(mla=dict(kv_rank=16)), r"mla needs position='rope'"),
    (dict(position="rope", mla=dict(rope_dim=8)), r"mla.rope_dim=8 must be below head_dim=8"),
    (dict(position="rope", num_kv_heads=2, mla=dict(rope_dim=4)), r"num_kv_heads=2 must equal num_heads=4"),
    (dict(position="rope", mla=dict(rope_dim=3)), r"mla.rope_dim must be even"),
    (dict(position="rope", mla=dict(rope_dim=4, kv_rnk=2)), r"mla has no field\(s\) \['kv_rnk'\]"),
    (dict(router_seq_aux_loss_coef=1e-4), r"router_seq_aux_loss_coef=0.0001 must be >= 0 and needs num_experts > 0"),
    (dict(num_experts=4, router_seq_aux_loss_coef=-1.0), r"router_seq_aux_loss_coef=-1.0 must be >= 0"),
])
def test_bad_configs_raise_clear_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        presets.tiny("decoder").replace(**changes)


def test_bad_inputs_raise_clear_errors():
    cfg = presets.tiny("decoder")  # learned positions, max_len 64, vocab 64
    model = DecoderLM(cfg)
    x = jnp.ones((2, 8), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"must lie in \[0, 64\); got values in \[1, 64\]"):
        model.apply(params, x.at[0, 3].set(64))
    with pytest.raises(ValueError, match=r"got values in \[-1, 1\]"):
        model.apply(params, x.at[0, 3].set(-1))
    with pytest.raises(ValueError, match="length 65 exceeds max_len=64"):
        model.apply(params, jnp.ones((1, 65), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids shape \(2, 7\) does not match tokens shape \(2, 8\)"):
        model.apply(params, x, segment_ids=jnp.ones((2, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        model.apply(params, jnp.ones((8,), jnp.int32))
    encdec = EncoderDecoder(presets.tiny("encdec"))
    p = encdec.init(jax.random.PRNGKey(0), x, x)
    with pytest.raises(ValueError, match="targets_segment_ids need inputs_segment_ids"):
        encdec.apply(p, x, x, targets_segment_ids=jnp.ones_like(x))
    bert = EncoderModel(presets.tiny("encoder"))
    p = bert.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\)"):
        bert.apply(p, x, token_type_ids=jnp.full_like(x, 2))
    with pytest.raises(ValueError, match="unknown family"):
        presets.tiny("rnn")


def test_derived_fields_are_set_and_follow_what_they_derive_from():
    """num_kv_heads, head_dim, num_decoder_layers and rope.dim are set once built (one name, one
    value); `replace` re-derives those still at their derivation, and keeps the ones set."""
    llama = presets.llama()  # D 4096, 32 heads, 8 kv heads
    assert (llama.head_dim, llama.num_kv_heads, llama.rope.dim) == (128, 8, 128)
    small = llama.replace(d_model=256, num_heads=4, num_kv_heads=2)
    assert (small.head_dim, small.rope.dim) == (64, 64)
    encdec = presets.transformer_base()
    assert encdec.num_decoder_layers == 6 and encdec.replace(num_layers=2).num_decoder_layers == 2
    assert encdec.replace(num_decoder_layers=3).replace(num_layers=2).num_decoder_layers == 3  # set: kept
    assert presets.tiny("llama", head_dim=16).replace(d_model=64).head_dim == 16
    partial = presets.tiny("llama", rope=dict(dim=4))
    assert partial.replace(d_model=64).rope.dim == 4
    mha = presets.gpt2_small()
    assert mha.num_kv_heads == 12 and mha.replace(num_heads=4).num_kv_heads == 4


def test_rope_is_one_nested_config():
    """A dict sets some RoPE fields over the current ones; a RopeConfig replaces them all; configs
    recorded with the old flat names (rope_theta, rotary_dim, ...) still load."""
    from tfm.config import RopeConfig
    cfg = presets.tiny("llama").replace(rope=dict(scaling="linear", factor=2.0))
    assert (cfg.rope.theta, cfg.rope.scaling, cfg.rope.factor) == (500_000.0, "linear", 2.0)
    assert cfg.replace(rope=RopeConfig(theta=10.0)).rope == RopeConfig(theta=10.0, dim=cfg.head_dim)
    record = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert record["rope"]["factor"] == 2.0 and ModelConfig.from_dict(record) == cfg
    legacy = {k: v for k, v in record.items() if k != "rope"}
    legacy.update(rope_theta=500_000.0, rope_scaling="linear", rope_scaling_factor=2.0, rotary_dim=None)
    assert ModelConfig.from_dict(legacy) == cfg
    with pytest.raises(ValueError, match=r"RoPE's settings are nested now: \['rope.theta'\]"):
        presets.build("llama", 64, {"rope_theta": 1e4})
    assert presets.build("tiny_llama", 64, {"rope": {"theta": 1e4}}).rope.theta == 1e4


@pytest.mark.parametrize("preset, total, active", [("mixtral_8x7b", 46.7e9, 12.9e9), ("deepseek_v3", 671e9, 37e9),
                                                   ("kimi_k2", 1.04e12, 32e9)])
def test_moe_presets_hold_their_published_sizes(preset, total, active):
    """Parameter counts by jax.eval_shape (nothing allocated) against the published totals and active
    parameters per token; active = what a token's forward multiplies with: all but the input
    embedding table and the experts it does not use. Within 1.5% (the published figures are rounded,
    and Kimi K2's "1.04T" and DeepSeek's "671B" leave out their multi-token-prediction modules)."""
    cfg = getattr(presets, preset)(scan_layers=True)
    n = count_params(DecoderLM(cfg), jnp.zeros((1, 8), jnp.int32))
    unused = (cfg.num_layers - cfg.dense_layers) * (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.d_ff
    act = n - unused - cfg.vocab_size * cfg.d_model
    print(f"{preset}: {n / 1e9:.2f}B total, {act / 1e9:.2f}B active")
    assert abs(n - total) / total < 0.015 and abs(act - active) / active < 0.015, (n, act)


# ModelConfig's top-level fields say what a model computes. A new one is classified here: a field
# that changes how a run executes the model (a backend, a chunking, tiles, a dtype, remat, scan, ...)
# and not the function it computes belongs in ExecutionConfig instead.
WHAT_FIELDS = (
    'vocab_size', 'd_model', 'num_heads', 'num_layers', 'd_ff', 'num_kv_heads', 'head_dim', 'num_decoder_layers',
    'max_len', 'norm', 'norm_eps', 'norm_position', 'final_norm', 'embedding_norm', 'norm_bias', 'position', 'rope',
    'alibi_bias_max', 'position_offset', 'padding_positions', 'relative_buckets', 'relative_max_distance',
    'attention_bias', 'attention_out_bias', 'attention_dropout', 'scale_attention', 'sliding_window',
    'attention_pattern', 'attn_logit_softcap', 'qk_norm', 'mla', 'value_rank', 'linformer_length',
    'attention_sparsity', 'global_projections', 'activation', 'ffn_bias', 'num_experts', 'experts_per_token',
    'router_aux_loss_coef', 'router_seq_aux_loss_coef', 'router_norm_topk', 'shared_expert_d_ff',
    'shared_expert_gate', 'router_score', 'router_groups', 'router_group_top', 'router_bias', 'router_bias_rate',
    'router_scale', 'dense_layers', 'dense_d_ff', 'parallel_block', 'parallel_norms', 'dropout_rate',
    'type_vocab_size', 'scale_embeddings', 'tie_embeddings', 'share_source_target_embeddings', 'output_bias',
    'rescale_tied_output', 'pad_id', 'heads', 'num_labels', 'head_activation', 'image_size', 'patch_size',
    'num_channels', 'multimodal', 'norm_scale_offset', 'attention_output_gate', 'mixer_pattern', 'ffn_pattern',
    'mixer_multipliers', 'embedding_scale_rounding', 'final_logit_softcap',
    'position_pattern', 'local_rope', 'qk_norm_scope', 'attention_scale', 'residual_multiplier', 'embedding_multiplier',
    'logits_multiplier', 'swiglu_limit', 'swiglu_alpha', 'router_logit_bias', 'attention_sinks',
    'qk_norm_position', 'attention_span', 'nope_temperature', 'nope_temperature_floor', 'rope_qk_rms_norm',
    'router_gate_input', 'key_multiplier', 'ffn_multipliers', 'skip_multipliers', 'indexer') + tuple(g.FIELD for g in mixer_groups())  # a mixer's group: its registration's field
_EXECUTION_LIKE = re.compile(r"impl|chunk|block_size|remat|scan|strategy|dtype|capacity|precision|kernel|backend")


def test_execution_settings_live_in_one_group():
    """Every top-level field is a classified 'what' field; none is named like an execution setting;
    and no tfm, experiments or benchmarks module lists execution fields again (ExecutionConfig.names())."""
    top = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "execution"]
    assert set(top) == set(WHAT_FIELDS), ("classify the new/removed ModelConfig fields (WHAT_FIELDS, or "
                                          f"ExecutionConfig if they change how, not what): {set(top) ^ set(WHAT_FIELDS)}")
    assert not [name for name in top if _EXECUTION_LIKE.search(name)]
    assert all(_EXECUTION_LIKE.search(name) for name in ExecutionConfig.names() if name != "context_strategy")
    names, found = set(ExecutionConfig.names()), []
    for folder in ("tfm", "experiments", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    strings = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                    if len(strings & names) >= 2:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"lists of execution fields (read ExecutionConfig.names()): {found}"


def test_execution_is_one_nested_group_and_flat_names_still_load():
    """A dict changes the fields it names over the current ones; flat names (replace, from_dict of an
    old record, experiment overrides) land in the group; a name given twice is refused."""
    cfg = presets.tiny("llama").replace(execution=dict(attention_impl="chunked", attention_chunk_size=16))
    assert (cfg.execution.attention_impl, cfg.execution.attention_chunk_size) == ("chunked", 16)
    assert cfg.replace(execution=dict(dtype="bfloat16")).execution.attention_chunk_size == 16
    assert cfg.replace(remat_policy="full").execution == dataclasses.replace(cfg.execution, remat_policy="full")
    record = json.loads(json.dumps(dataclasses.asdict(cfg.replace(attention_impl="pallas"))))
    assert ModelConfig.from_dict(record).execution.attention_impl == "pallas"
    flat = {k: v for k, v in record.items() if k != "execution"}
    flat.update(record["execution"])
    assert ModelConfig.from_dict(flat) == ModelConfig.from_dict(record)
    assert presets.build("tiny_llama", 64, {"scan_layers": True}).execution.scan_layers
    assert presets.build("tiny_llama", 64, {"execution": {"scan_layers": True}}).execution.scan_layers
    with pytest.raises(ValueError, match=r"\['dtype'\] given both flat and in execution"):
        cfg.replace(dtype="float16", execution=dict(dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"execution has no field\(s\) \['dtpye'\]"):
        cfg.replace(execution=dict(dtpye="bfloat16"))
    with pytest.raises(ValueError, match=r"execution.attention_block_sizes are the Pallas kernels' tiles"):
        cfg.replace(attention_block_sizes=(16, 16))


def test_a_backend_declaration_drives_validation_auto_and_the_entry_point(monkeypatch):
    """Flip one declaration in tfm.capabilities: ModelConfig validation, `auto` and the entry point follow."""
    from tfm import capabilities
    from tfm.ops import attention, select
    monkeypatch.setattr(select, "current_platform", lambda: "tpu")
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)

    def outcome():
        try:
            presets.tiny("encoder", attention_dropout=0.1, attention_impl="pallas")
        except ValueError as e:
            assert "attention_dropout needs an attention backend that implements dropout" in str(e)
            return False, select.choose_impl(q, q, dropout_rate=0.1)
        return True, select.choose_impl(q, q, dropout_rate=0.1)

    pallas = capabilities.ATTENTION["pallas"]
    for declared in (pallas.dropout, not pallas.dropout):
        monkeypatch.setitem(capabilities.ATTENTION, "pallas", dataclasses.replace(pallas, dropout=declared))
        assert outcome() == (declared, "pallas" if declared else "xla")
    monkeypatch.setitem(capabilities.ATTENTION, "pallas", dataclasses.replace(pallas, dropout=False))
    x = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"^attention impl 'pallas' does not implement dropout \(impl 'xla'"):
        attention.dot_product_attention(x, x, x, dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0), impl="pallas")
    presets.tiny("encdec", position="relative")
    monkeypatch.setitem(capabilities.ATTENTION, "xla", dataclasses.replace(capabilities.ATTENTION["xla"], bias=False))
    with pytest.raises(ValueError, match=r"position='relative' .* needs an attention backend that implements bias"):
        presets.tiny("encdec", position="relative")


def test_import_of_the_config_loads_no_kernel():
    import subprocess
    import sys
    code = ("import sys, tfm.config; bad = [m for m in sys.modules if m.startswith(('tfm.ops', 'tfm.kernels.flash', "
            "'jax.experimental.pallas'))]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("fields, message", [
    (dict(mixer_pattern=("shared",)), r"'shared': a shared block feeds a mixer's input \('shared>a'\)"),
    (dict(mixer_pattern=("shared>mamba2",), norm_position="post"), r"needs norm_position='pre' and a sequential block"),
    (dict(mixer_pattern=("mamba2>attention+mamba2>mamba2",)), r"'f>a' feeds one kind f into the input"),
    (dict(mixer_pattern=("mamba2", "shared>mamba2"), num_layers=4, shared_block=dict(blocks=2)),
     r"shared_block.blocks=2 must divide the 1 uses in each repeat of mixer_pattern \(period 2\)"),
])
def test_fed_entries_and_shared_blocks_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ModelConfig(**{**dict(vocab_size=32, d_model=32, num_heads=2, d_ff=64, num_layers=2, mamba2=dict(head_dim=16)),
                       **fields})
    assert "\n" not in str(error.value)
