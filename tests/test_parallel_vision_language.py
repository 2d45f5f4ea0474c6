"""Sharded training of the Llama 3.2 Vision layout (VisionLanguageModel, ImageTextTask) equals
single-device training: per-step losses of a short Adam run, fsdp x tensor mesh vs one device."""
import jax
import numpy as np

from parallel_cases import MESHES
from tfm.config import ModelConfig
from tfm.models import VisionLanguageModel
from tfm.parallel import make_mesh
from tfm.train import ImageTextTask, OptimizerConfig, TrainConfig, Trainer

TOL = 1e-5  # fp32, absolute on the loss
B, T, V, I, X, SIZE, STEPS = 8, 8, 64, 1, 2, 8, 3


def model():
    vision = ModelConfig(vocab_size=1, d_model=16, num_heads=2, num_layers=1, d_ff=32, norm_eps=1e-5, final_norm=False,
                         position="none", activation="gelu", attention_bias=False, image_size=SIZE, patch_size=4,
                         multimodal=dict(max_num_tiles=X, max_aspect_ratio_id=3, num_global_layers=1,
                                         intermediate_layers=(0,)))
    text = ModelConfig(vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48, norm="rmsnorm",
                       position="rope", activation="swiglu", attention_bias=False, ffn_bias=False, tie_embeddings=False,
                       multimodal=dict(cross_attention_layers=(1,), extra_tokens=8, vision=vision))
    return VisionLanguageModel(text)


def batch():
    rng = np.random.default_rng(0)
    y = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    return {"inputs": y[:, :-1], "targets": y[:, 1:], "weights": np.ones((B, T), np.float32),
            "images": rng.normal(size=(B, I, X, SIZE, SIZE, 3)).astype(np.float32),
            "aspect_ratio_ids": rng.integers(1, 4, (B, I)).astype(np.int32),
            "aspect_ratio_mask": np.stack([np.ones((B, I)), rng.integers(0, 2, (B, I))], -1).astype(np.int32),
            "cross_attention_mask": rng.integers(0, 2, (B, T, I, X)).astype(np.int32)}


def losses(mesh_name):
    mesh_cfg, parallelism = MESHES[mesh_name]
    b = batch()
    cfg = TrainConfig(num_train_steps=STEPS, batch_size=B, mesh=mesh_cfg, parallelism=parallelism,
                      optimizer=OptimizerConfig(name="adam", learning_rate=5e-3))
    n = int(np.prod(mesh_cfg.ici_sizes()))
    trainer = Trainer(model(), ImageTextTask(), cfg, make_mesh(mesh_cfg, jax.devices()[:n])).setup(b)
    state, out = trainer.init_state(), []
    for _ in range(STEPS):
        state, m = trainer.train_step(state, trainer.global_batch(b))
        out.append(float(m["loss"]))
    return np.array(out)


def test_sharded_losses_match_single_device():
    ref, got = losses("single"), losses("fsdp4_tensor2")
    print(f"losses single {ref}, fsdp4_tensor2 {got}")
    assert ref[0] - ref[-1] > 0.05, f"the reference run should learn: {ref}"
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
