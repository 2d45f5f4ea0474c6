"""Shared by the sharded-vs-single-device tests: tiny models, batches, and a 5-step run."""
import functools

import jax
import numpy as np

from tfm.models import DecoderLM, EncoderDecoder, EncoderModel
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, make_mesh
from tfm.train import LMTask, MLMTask, OptimizerConfig, Seq2SeqTask, TrainConfig, Trainer

B, T, V, STEPS = 8, 16, 64, 5
MESHES = {  # name -> (mesh config, rule sets)
    "single": (MeshConfig(data=1), "data"),
    "data8": (MeshConfig(data=8), "data"),
    "fsdp8": (MeshConfig(data=1, fsdp=8), "fsdp"),
    "data2_tensor4": (MeshConfig(data=2, tensor=4), "data+tensor"),
    "fsdp4_tensor2": (MeshConfig(data=1, fsdp=4, tensor=2), "fsdp+tensor"),
    "expert4_data2": (MeshConfig(data=2, expert=4), "data+expert"),
    "fsdp4_expert2": (MeshConfig(data=1, fsdp=4, expert=2), "fsdp+expert"),  # params over fsdp x expert
    "data2_context4": (MeshConfig(data=2, context=4), "data+context"),
    "context4": (MeshConfig(data=1, context=4), "context"),
    "context2_tensor2": (MeshConfig(data=1, context=2, tensor=2), "context+tensor"),
}


def _batch(family, rng):
    if family == "encoder":
        return {"input_ids": rng.integers(1, V, (B, T)).astype(np.int32),
                "token_type_ids": (np.arange(T) >= T // 2).astype(np.int32)[None].repeat(B, 0),
                "attention_mask": (np.arange(T) < T - 2).astype(np.int32)[None].repeat(B, 0),
                "mlm_positions": rng.integers(0, T - 2, (B, 4)).astype(np.int32),
                "mlm_ids": rng.integers(1, V, (B, 4)).astype(np.int32),
                "mlm_weights": np.array([1, 1, 1, 0], np.float32)[None].repeat(B, 0),
                "nsp_label": rng.integers(0, 2, (B,)).astype(np.int32)}
    y = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    weights = np.ones((B, T), np.float32)
    weights[:, -3:] = 0  # padding
    if family == "encdec":
        return {"inputs": rng.integers(1, V, (B, T)).astype(np.int32), "targets_in": y[:, :-1],
                "targets": y[:, 1:], "weights": weights}
    return {"inputs": y[:, :-1], "targets": y[:, 1:], "weights": weights}


# Families that are a tiny preset with overrides: name -> (preset family, overrides)
VARIANTS = {"latent_attention": ("llama", dict(num_kv_heads=4, head_dim=12,
                                               mla=dict(kv_rank=16, rope_dim=4, q_rank=8, value_dim=6))),
            # a Mamba-2 layer (8 heads in 2 B/C groups, chunks of 4) and an attention layer
            "hybrid": ("hybrid", dict(num_layers=2))}


def setup(family):
    model = {"encoder": EncoderModel, "encdec": EncoderDecoder}.get(family, DecoderLM)
    task = {"encoder": MLMTask, "encdec": Seq2SeqTask}.get(family, LMTask)()
    preset, overrides = VARIANTS.get(family, (family, {}))
    return model(tiny(preset, **{"num_layers": 1, **overrides})), task  # one layer: compile time dominates


@functools.lru_cache(maxsize=None)
def losses(family: str, mesh_name: str) -> tuple:
    """Per-step losses of a 5-step Adam run on the named mesh (fp32)."""
    mesh_cfg, parallelism = MESHES[mesh_name]
    model, task = setup(family)
    rng = np.random.default_rng(0)
    batches = [_batch(family, rng)] * STEPS  # one batch, memorised: the loss must fall
    cfg = TrainConfig(num_train_steps=STEPS, batch_size=B, mesh=mesh_cfg, parallelism=parallelism,
                      optimizer=OptimizerConfig(name="adam", learning_rate=5e-3))
    n = int(np.prod(mesh_cfg.ici_sizes()))
    trainer = Trainer(model, task, cfg, make_mesh(mesh_cfg, jax.devices()[:n])).setup(batches[0])
    state, out = trainer.init_state(), []
    for b in batches:
        state, m = trainer.train_step(state, trainer.global_batch(b))
        out.append(float(m["loss"]))
    return tuple(out)
