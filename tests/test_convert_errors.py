"""tfm.convert refuses what it cannot convert faithfully, with errors that name the cause."""
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from tfm.convert import ConversionError, from_hf  # noqa: E402

EAGER = dict(attn_implementation="eager")
MODELS = {
    "bert": lambda: tr.BertForPreTraining(tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=24,
                                                        max_position_embeddings=16, **EAGER)),
    "gpt2": lambda: tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                                     **EAGER)),
    "llama": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=1, **EAGER)),
    "qwen2_moe": lambda: tr.Qwen2MoeForCausalLM(tr.Qwen2MoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
        **EAGER)),
    "marian": lambda: tr.MarianMTModel(tr.MarianConfig(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
                                                       encoder_attention_heads=2, decoder_attention_heads=2,
                                                       encoder_ffn_dim=24, decoder_ffn_dim=24, pad_token_id=49,
                                                       decoder_start_token_id=49, eos_token_id=0,
                                                       forced_eos_token_id=0, max_position_embeddings=16, **EAGER)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> save_pretrained directory of a tiny model (each converts cleanly)."""
    torch.manual_seed(0)
    dirs = {}
    for name, make in MODELS.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        make().save_pretrained(dirs[name])
    return dirs


def edited(checkpoints, name, tmp_path, drop=(), **changes):
    """A copy of a checkpoint directory with config.json fields changed or dropped."""
    path = tmp_path / f"{name}_edited"
    shutil.copytree(checkpoints[name], path)
    config = json.loads((path / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", sorted(MODELS))
def test_clean_checkpoints_convert(checkpoints, name):
    from_hf(checkpoints[name])


@pytest.mark.parametrize("name, changes, field", [
    # llama3, yarn and dynamic scalings convert (tests/test_zoo_decoders.py); Phi-3's longrope does not
    ("llama", dict(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                    "long_factor": [1.0] * 4, "original_max_position_embeddings": 16}), "rope_type"),
    ("llama", dict(rope_parameters=None, rope_scaling={"type": "longrope", "factor": 2.0, "short_factor": [1.0] * 4,
                                                       "long_factor": [1.0] * 4}), "rope_scaling"),
    ("llama", dict(hidden_act="quick_gelu"), "hidden_act"),  # no gated form of it in tfm
    ("llama", dict(tie_word_embeddings=True), "tie_word_embeddings"),  # lm_head differs from the embedding
    ("qwen2_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),  # dense layers between MoE ones
    ("qwen2_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("bert", dict(position_embedding_type="relative_key"), "position_embedding_type"),
    ("bert", dict(hidden_act="quick_gelu"), "hidden_act"),
    ("bert", dict(is_decoder=True), "is_decoder"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights"),
    ("marian", dict(decoder_ffn_dim=32), "decoder_ffn_dim"),
    ("marian", dict(decoder_attention_heads=4), "decoder_attention_heads"),
    ("marian", dict(normalize_before=True), "normalize_before"),
    ("marian", dict(add_final_layer_norm=True), "add_final_layer_norm"),
    ("marian", dict(decoder_vocab_size=60), "decoder_vocab_size"),
    ("marian", dict(activation_function="gelu_fast"), "activation_function"),
    ("gpt2", dict(architectures=["GPT2ForTokenClassification"]), "not supported"),
    ("gpt2", dict(architectures=[]), "architectures"),
])
def test_unsupported_config_field(checkpoints, tmp_path, name, changes, field):
    with pytest.raises(ValueError, match=field):
        from_hf(edited(checkpoints, name, tmp_path, **changes))


def test_unsupported_live_model():
    model = tr.GPT2Model(tr.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, **EAGER))
    with pytest.raises(ValueError, match="'GPT2Model' is not supported"):
        from_hf(model)


def test_untied_marian_positions_refused():
    """Marian's stored position table must be the sinusoid tfm computes."""
    model = MODELS["marian"]()
    with torch.no_grad():
        model.model.encoder.embed_positions.weight.add_(0.1)
    with pytest.raises(ValueError, match="embed_positions"):
        from_hf(model)


def test_overrides_that_change_the_math_are_refused(checkpoints):
    with pytest.raises(ValueError, match="cannot override"):
        from_hf(checkpoints["gpt2"], norm_eps=1e-3)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_hf(tmp_path / "nowhere")


def test_directory_without_config(checkpoints, tmp_path):
    shutil.copy(checkpoints["gpt2"] / "model.safetensors", tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf(tmp_path)


def test_directory_without_weights(checkpoints, tmp_path):
    shutil.copy(checkpoints["gpt2"] / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        from_hf(tmp_path)


def test_invalid_config_json(checkpoints, tmp_path):
    path = edited(checkpoints, "gpt2", tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_hf(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(checkpoints, tmp_path, damage):
    path = edited(checkpoints, "gpt2", tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        from_hf(path)


def test_missing_and_unexpected_tensors(checkpoints, tmp_path):
    path = edited(checkpoints, "gpt2", tmp_path)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "transformer.h.0.mlp.c_fc.bias"}, path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks tensor 'transformer.h.0.mlp.c_fc.bias'"):
        from_hf(path)
    save_file({**tensors, "transformer.h.0.attn.extra.weight": tensors["transformer.ln_f.weight"].clone()},
              path / "model.safetensors")
    with pytest.raises(ValueError, match="no tfm counterpart"):
        from_hf(path)


def test_wrong_tensor_shape(checkpoints, tmp_path):
    path = edited(checkpoints, "gpt2", tmp_path, n_positions=32)  # config disagrees with the wpe table
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        from_hf(path)


def test_errors_are_conversion_errors():
    assert issubclass(ConversionError, ValueError)
