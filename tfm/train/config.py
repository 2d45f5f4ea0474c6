"""Frozen training configuration, every field validated with a message that names it."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from tfm.parallel.mesh import MeshConfig

# The OptimizerConfig fields each optimizer and each schedule reads (name, learning_rate,
# schedule and clip_grad_norm are always read); a field set to anything but its default where
# nothing reads it is refused.
OPTIMIZER_READS = {"adam": ("b1", "b2", "eps", "bias_correction"),
                   "adamw": ("b1", "b2", "eps", "bias_correction", "weight_decay", "decay_mask"),
                   "lamb": ("b1", "b2", "eps", "weight_decay", "decay_mask"),
                   "adafactor": ("weight_decay", "decay_mask"),
                   "sgd": ()}
_DECAYING = ("warmup_steps", "decay_steps", "end_lr_factor")
SCHEDULE_READS = {"constant": ("warmup_steps",), "noam": ("warmup_steps", "noam_d_model"),
                  "linear": _DECAYING, "cosine": _DECAYING, "bert_linear": _DECAYING}
OPTIMIZERS, SCHEDULES = tuple(OPTIMIZER_READS), tuple(SCHEDULE_READS)
_READ_SOMETIMES = {f for reads in (*OPTIMIZER_READS.values(), *SCHEDULE_READS.values()) for f in reads}


def refuse_unread(obj, candidates, read, context: str) -> None:
    """Raises ValueError naming the first field of dataclass `obj` among `candidates` that is set
    to other than its default although it is not in `read` (what the chosen variant uses), so a
    value nothing reads is never dropped silently; `context` says why it is not read."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in candidates and f.name not in read and value != f.default:
            raise ValueError(f"{type(obj).__name__}.{f.name}={value!r} is not read {context}; "
                             f"leave it at its default {f.default!r}")


def _require(ok: bool, owner: str, field: str, value, what: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{field} must be {what}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"              # OPTIMIZER_READS says which fields below each reads
    learning_rate: float = 1e-3      # peak; for "noam" with noam_d_model set, the paper's factor
    b1: float = 0.9                  # decay of the gradient's running mean
    b2: float = 0.999                # decay of its square's running mean
    eps: float = 1e-8                # added to the root of that mean
    bias_correction: bool = True     # adam / adamw; False: m / (sqrt(v) + eps) as BERT's
                                     # AdamWeightDecayOptimizer (no 1 - b^t divisors)
    weight_decay: float = 0.0        # adamw / lamb / adafactor
    decay_mask: str = "kernels"      # "kernels": weight matrices and embeddings decay, biases
                                     # (any shape) and norm scales do not; or "all"
    schedule: str = "constant"       # "bert_linear": BERT's create_optimizer, whose linear decay
                                     # counts from step 0 (lr * (1 - step / decay_steps) after warmup)
    warmup_steps: int = 0            # linear warmup from 0 to the peak
    decay_steps: Optional[int] = None  # linear/cosine/bert_linear: defaults to the run's length
    end_lr_factor: float = 0.0       # linear/cosine/bert_linear: final lr = peak * end_lr_factor
    noam_d_model: Optional[int] = None  # noam: peak = learning_rate * noam_d_model^-0.5 * warmup^-0.5
    clip_grad_norm: Optional[float] = 1.0  # the global gradient norm clipped to this; None = no clipping
    frozen: Optional[str] = None     # regex matched at the start of parameter paths
                                     # ("text/decoder/layer_0/ffn/wo/kernel"): those are never updated
                                     # and hold no optimizer state (must match some, not all)
    CHOICES = dict(name=OPTIMIZERS, schedule=SCHEDULES, decay_mask=("kernels", "all"))  # checked below

    def __post_init__(self):
        check = lambda ok, field, what: _require(ok, "OptimizerConfig", field, getattr(self, field), what)
        check(self.name in OPTIMIZERS, "name", f"one of {OPTIMIZERS}")
        check(self.schedule in SCHEDULES, "schedule", f"one of {SCHEDULES}")
        check(self.decay_mask in ("kernels", "all"), "decay_mask", "'kernels' or 'all'")
        check(self.learning_rate > 0, "learning_rate", "> 0")
        check(0 <= self.b1 < 1, "b1", "in [0, 1)")
        check(0 <= self.b2 < 1, "b2", "in [0, 1)")
        check(self.eps >= 0, "eps", ">= 0")
        check(self.weight_decay >= 0, "weight_decay", ">= 0")
        check(self.warmup_steps >= 0, "warmup_steps", ">= 0")
        check(self.decay_steps is None or self.decay_steps >= 1, "decay_steps", "None or >= 1")
        check(0 <= self.end_lr_factor <= 1, "end_lr_factor", "in [0, 1]")
        check(self.noam_d_model is None or self.noam_d_model >= 1, "noam_d_model", "None or >= 1")
        check(self.clip_grad_norm is None or self.clip_grad_norm > 0, "clip_grad_norm", "None or > 0")
        check(self.frozen is None or (isinstance(self.frozen, str) and self.frozen), "frozen",
              "None or a non-empty regular expression")
        if self.frozen is not None:
            try:
                re.compile(self.frozen)
            except re.error as e:
                raise ValueError(f"OptimizerConfig.frozen={self.frozen!r} is not a regular expression ({e})") from None
        read = set(OPTIMIZER_READS[self.name]) | set(SCHEDULE_READS[self.schedule])
        refuse_unread(self, _READ_SOMETIMES, read, f"with name={self.name!r} and schedule={self.schedule!r} "
                      f"(they read {sorted(read)}; another optimizer or schedule may)")
        if self.schedule == "noam" and self.warmup_steps < 1:
            raise ValueError("OptimizerConfig.warmup_steps must be >= 1 for the noam schedule")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train; the loss weights (label smoothing, z-loss, MoE aux) belong to the Task."""

    num_train_steps: int = 1000      # optimizer steps of the whole run
    batch_size: int = 8              # global, across all hosts
    microbatches: int = 1            # gradient accumulation: batch_size / microbatches per pass
    seed: int = 0                    # the parameters' init, dropout and the data order
    optimizer: OptimizerConfig = OptimizerConfig()  # the optimizer and its schedule (optimizer.* below)
    mesh: MeshConfig = MeshConfig()  # devices per mesh axis (mesh.* below)
    parallelism: str = "data"        # rule sets joined by "+", e.g. "fsdp+tensor"
    on_nonfinite: str = "stop"       # "stop": raise naming the step; "skip": drop the update
    log_every: int = 50              # steps between logged training metrics
    eval_every: int = 0              # 0: only at the end
    keep_best: Optional[str] = None  # eval metric whose best value's checkpoint is kept in best/
    keep_best_mode: str = "max"      # "max" or "min" for keep_best
    checkpoint_every: int = 1000     # 0: no periodic checkpoints (the last step is always saved)
    keep_checkpoints: int = 3        # the newest this many checkpoints are kept
    async_checkpoint: bool = True    # checkpoints written in the background while training goes on
    fallback_to_older: bool = True   # a corrupt latest checkpoint is moved aside, the next older used
    preemption_check_every: int = 10  # multi-host: steps between agreements on a stop signal
    spike_factor: Optional[float] = None  # a loss above this x its running median (or a non-finite one,
                                     # with on_nonfinite="stop") rolls the run back to the newest
                                     # checkpoint before it and skips spike_skip_batches batches. None: off
    spike_window: int = 100          # losses in that running median (checked once it is full)
    spike_skip_batches: Optional[int] = None  # batches of the stream skipped after rolling back (>=
                                     # checkpoint_every, so the one that spiked is among them). None: checkpoint_every
    spike_max_recoveries: int = 3    # recoveries allowed within spike_recovery_window steps; one more spike
                                     # stops the run in one line
    spike_recovery_window: int = 1000  # steps over which spike_max_recoveries counts recoveries
    replica_check_every: int = 0     # steps between comparisons of the data-parallel replicas' parameter
                                     # checksums (also before each save); a mismatch stops the run. 0: off
    watchdog_timeout: float = 600.0  # s: a step or batch read that makes no progress for max(this,
                                     # watchdog_step_factor x the median step) ends every process of
                                     # the job in one line (exit status 75). 0: no watchdog
    watchdog_step_factor: float = 20.0  # the median steps a step may take before the watchdog acts
    watchdog_slow_timeout: float = 3600.0  # s: the same bound for the first step (compiling), a checkpoint
                                     # save and an evaluation
    progress_bar: bool = True        # a progress bar on a terminal (a log gets plain lines)
    wandb_project: Optional[str] = None  # log to wandb when set and installed
    peak_flops_per_device: Optional[float] = None  # for MFU; default from the device kind
    CHOICES = dict(on_nonfinite=("stop", "skip"), keep_best_mode=("max", "min"))  # checked below

    def __post_init__(self):
        check = lambda ok, field, what: _require(ok, "TrainConfig", field, getattr(self, field), what)
        for field in ("num_train_steps", "batch_size", "microbatches", "log_every", "keep_checkpoints",
                      "preemption_check_every"):
            check(isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field, "an integer >= 1")
        for field in ("eval_every", "checkpoint_every", "replica_check_every"):
            check(isinstance(getattr(self, field), int) and getattr(self, field) >= 0, field, "an integer >= 0")
        check(self.on_nonfinite in ("stop", "skip"), "on_nonfinite", "'stop' or 'skip'")
        for field in ("spike_window", "spike_max_recoveries", "spike_recovery_window"):
            check(isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field, "an integer >= 1")
        spikes = ("spike_window", "spike_skip_batches", "spike_max_recoveries", "spike_recovery_window")
        refuse_unread(self, spikes, () if self.spike_factor is None else spikes,
                      "without TrainConfig.spike_factor (set it to recover from loss spikes)")
        check(isinstance(self.watchdog_timeout, (int, float)) and self.watchdog_timeout >= 0, "watchdog_timeout",
              "a number of seconds >= 0 (0: no watchdog)")
        refuse_unread(self, ("watchdog_step_factor", "watchdog_slow_timeout"),
                      ("watchdog_step_factor", "watchdog_slow_timeout") if self.watchdog_timeout else (),
                      "with TrainConfig.watchdog_timeout=0 (no watchdog)")
        check(isinstance(self.watchdog_step_factor, (int, float)) and self.watchdog_step_factor >= 1,
              "watchdog_step_factor", "a number >= 1")
        check(isinstance(self.watchdog_slow_timeout, (int, float)) and self.watchdog_slow_timeout > 0,
              "watchdog_slow_timeout", "a number of seconds > 0")
        if self.spike_factor is not None:
            check(isinstance(self.spike_factor, (int, float)) and self.spike_factor > 1, "spike_factor", "None or > 1")
            check(self.checkpoint_every >= 1, "checkpoint_every", ">= 1 with spike_factor set (a spike rolls "
                  "back to the newest checkpoint)")
            check(self.spike_skip_batches is None or (isinstance(self.spike_skip_batches, int)
                                                      and self.spike_skip_batches >= self.checkpoint_every),
                  "spike_skip_batches", f"None or an integer >= checkpoint_every ({self.checkpoint_every}), so "
                  "the batch that spiked is among those skipped")
        check(self.keep_best_mode in ("max", "min"), "keep_best_mode", "'max' or 'min'")
        refuse_unread(self, ("keep_best_mode",), () if self.keep_best is None else ("keep_best_mode",),
                      "without TrainConfig.keep_best (the eval metric to keep the best checkpoint of)")
        check(self.peak_flops_per_device is None or self.peak_flops_per_device > 0,
              "peak_flops_per_device", "None or > 0")
        if self.batch_size % self.microbatches:
            raise ValueError(f"TrainConfig.batch_size {self.batch_size} is not divisible by "
                             f"TrainConfig.microbatches {self.microbatches}")
