"""The 2025-26 hybrids' published sizes (their parity, decode, packing and export are tests/test_zoo_recurrent.py's
families): each preset is what the converter makes of the published config (every field but pad_id, the execution
settings and max_len, which a Mamba's config does not have), and its parameters (jax.eval_shape) number what
transformers builds for that config on the meta device."""
import jax
import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

# Published sizes: the preset is what the converter makes of the published config, and counts what transformers builds
PUBLISHED = {
    "lfm2_1_2b": ("Lfm2ForCausalLM", lambda: tr.Lfm2Config(
        hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], max_position_embeddings=128_000)),
    "falcon_mamba_7b": ("FalconMambaForCausalLM", lambda: tr.FalconMambaConfig(
        vocab_size=65_024, hidden_size=4096, num_hidden_layers=64, state_size=16, expand=2, conv_kernel=4,
        time_step_rank=256, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_size_is_the_converted_config_and_counts_what_transformers_builds(name):
    import dataclasses
    from tfm.convert import CONVERTERS
    from tfm.models import DecoderLM, presets
    arch, published = PUBLISHED[name]
    with torch.device("meta"):
        count = sum(p.numel() for p in getattr(tr, arch)(published()).parameters())
    cfg = presets.PRESETS[name]()
    converted = CONVERTERS[arch].read_config(published().to_dict(), arch)
    differ = {f.name: (getattr(cfg, f.name), getattr(converted, f.name)) for f in dataclasses.fields(cfg)
              if f.name not in ("pad_id", "execution", "max_len") and getattr(cfg, f.name) != getattr(converted, f.name)}
    assert not differ, differ
    shapes = jax.eval_shape(lambda: DecoderLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == count
    print(f"{name}: {count / 1e9:.3f}B parameters")
