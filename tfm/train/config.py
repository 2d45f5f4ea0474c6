"""Frozen training configuration."""
from __future__ import annotations

import dataclasses
from typing import Optional

from tfm.parallel.mesh import MeshConfig

OPTIMIZERS = ("adam", "adamw", "lamb", "adafactor", "sgd")
SCHEDULES = ("constant", "noam", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    learning_rate: float = 1e-3      # peak; for "noam" with noam_d_model set, the paper's factor
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0        # adamw / lamb
    decay_mask: str = "kernels"      # "kernels": only params with ndim >= 2 decay; or "all"
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # linear/cosine: defaults to the run's length
    end_lr_factor: float = 0.0       # linear/cosine: final lr = peak * end_lr_factor
    noam_d_model: Optional[int] = None
    clip_grad_norm: Optional[float] = 1.0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} unknown; choose from {OPTIMIZERS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} unknown; choose from {SCHEDULES}")
        if self.decay_mask not in ("kernels", "all"):
            raise ValueError(f"decay_mask must be 'kernels' or 'all', got {self.decay_mask!r}")
        if self.schedule == "noam" and self.warmup_steps < 1:
            raise ValueError("the noam schedule needs warmup_steps >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_train_steps: int = 1000
    batch_size: int = 8              # global, across all hosts
    microbatches: int = 1            # gradient accumulation: batch_size / microbatches per pass
    seed: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    moe_aux_weight: float = 1.0  # multiplies the sown loss (the model applies its router coefficient)
    mesh: MeshConfig = MeshConfig()
    parallelism: str = "data"        # rule sets joined by "+", e.g. "fsdp+tensor"
    on_nonfinite: str = "stop"       # "stop": raise naming the step; "skip": drop the update
    log_every: int = 50
    eval_every: int = 0              # 0: only at the end
    checkpoint_every: int = 1000     # 0: no periodic checkpoints
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    progress_bar: bool = True
    wandb_project: Optional[str] = None  # log to wandb when set and installed
    peak_flops_per_device: Optional[float] = None  # for MFU; default from the device kind

    def __post_init__(self):
        if self.batch_size % self.microbatches:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by "
                             f"microbatches {self.microbatches}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
