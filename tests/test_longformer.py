"""Longformer: HF `LongformerModel` (PyTorch, CPU, fp32, tiny random config, every parameter perturbed) against
tfm's EncoderModel with attention_sparsity=Longformer and global_projections, through the xla reference and the
Pallas kernels (interpret mode): hidden states and pooled output max-abs < 1e-4 on right-padded rows whose
length is not a multiple of HF's attention_window (HF pads to one; tfm does not need to)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from test_convert_parity import max_abs, padding_mask, randomize  # noqa: E402
from tfm.convert import ConversionError, from_hf  # noqa: E402
from tfm.convert import longformer as longformer_convert  # noqa: E402
from tfm.convert.common import HFConfig  # noqa: E402
from tfm.kernels.tiles import BlockSizes  # noqa: E402
from tfm.models import EncoderModel  # noqa: E402
from tfm.kernels.sparsity import Longformer  # noqa: E402

TOL = 1e-4
V, B, T, WINDOW, GLOBALS = 100, 2, 21, 6, 2  # one-sided window 3: tfm's Longformer(window=4)


@pytest.fixture(scope="module")
def longformer():
    torch.manual_seed(0)
    hf = randomize(tr.LongformerModel(tr.LongformerConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, attention_window=WINDOW, pad_token_id=1)))
    return hf, from_hf(hf)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_longformer_model_matches_hf(longformer, impl):
    hf, (cfg, params, _) = longformer
    assert cfg.attention_sparsity == Longformer(window=WINDOW // 2 + 1, globals=0) and cfg.global_projections
    cfg = cfg.replace(attention_sparsity=Longformer(window=WINDOW // 2 + 1, globals=GLOBALS), attention_impl=impl,
                      attention_dropout=0.0, attention_block_sizes=BlockSizes(8, 8) if impl == "pallas" else None)
    mask = padding_mask([T, 14], T)
    ids = np.where(mask == 1, np.random.default_rng(0).integers(2, V, (B, T)), hf.config.pad_token_id)
    global_mask = (np.arange(T) < GLOBALS)[None].repeat(B, 0).astype(np.int64)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), global_attention_mask=torch.tensor(global_mask))
    out = jax.jit(EncoderModel(cfg).apply)({"params": params}, jnp.asarray(ids), segment_ids=jnp.asarray(mask))
    diffs = {"hidden": max_abs(out.hidden, ref.last_hidden_state, mask),
             "pooled": max_abs(out.pooled, ref.pooler_output)}
    print(f"LongformerModel[{impl}] max-abs {diffs}")
    assert max(diffs.values()) < TOL, diffs


def test_the_import_is_the_bare_class_default_forward(longformer):
    """LongformerModel(input_ids) with no global_attention_mask attends locally everywhere; so does the
    import (globals=0), within TOL; making the first token global changes it by O(1)."""
    hf, (cfg, params, _) = longformer
    ids = np.random.default_rng(1).integers(2, V, (B, T))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).last_hidden_state.numpy()
    out = EncoderModel(cfg).apply({"params": params}, jnp.asarray(ids)).hidden
    assert np.abs(np.asarray(out) - ref).max() < TOL
    one = cfg.replace(attention_sparsity=Longformer(window=WINDOW // 2 + 1, globals=1))
    assert np.abs(np.asarray(EncoderModel(one).apply({"params": params}, jnp.asarray(ids)).hidden) - ref).max() > 0.1


def test_global_projections_are_refused_without_a_longformer_pattern(longformer):
    _, (cfg, _, _) = longformer
    with pytest.raises(ValueError, match="global_projections needs"):
        cfg.replace(attention_sparsity=None)
    with pytest.raises(ValueError, match="attention_impl='cudnn' does not"):
        cfg.replace(attention_impl="cudnn", attention_dropout=0.0)


def test_saved_checkpoint_converts_to_the_same_params(longformer, tmp_path):
    hf, (cfg, params, _) = longformer
    hf.save_pretrained(tmp_path)
    saved_cfg, saved_params, _ = from_hf(str(tmp_path))
    assert saved_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, saved_params, params)


def test_per_layer_windows_that_differ_are_refused():
    fields = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=37,
                  attention_window=[4, 6])
    with pytest.raises(ConversionError, match="differs between layers"):
        longformer_convert.config(HFConfig(fields, "LongformerModel"))
