"""Train state, optimizers and schedules, losses, tasks, the loop, checkpoints, metrics."""
from tfm.train.checkpoint import Checkpointer, CheckpointError, average_checkpoints
from tfm.train.config import OptimizerConfig, TrainConfig
from tfm.train.losses import LossTerm, cross_entropy
from tfm.train.metrics import MetricLogger, flops_per_token
from tfm.train.optim import make_optimizer, make_schedule
from tfm.train.state import TrainState
from tfm.train.step import make_eval_step, make_train_step
from tfm.train.tasks import (ClassificationTask, ImageTextTask, LMClassificationTask, LMTask, MLMTask, RegressionTask,
                             Seq2SeqTask, SpanTask, Task)
from tfm.train.hooks import Hook, default_hooks
from tfm.train.trainer import Run, TrainResult, Trainer, train_and_evaluate
