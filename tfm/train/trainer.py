"""Trainer: shardings from logical rules, the jitted train step, and the training loop."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from typing import Any, Callable, Iterable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm import parallel
from tfm.train.checkpoint import Checkpointer
from tfm.train.config import TrainConfig
from tfm.train.metrics import MetricLogger, peak_flops
from tfm.train.optim import make_optimizer
from tfm.train.state import TrainState
from tfm.train.step import make_eval_step, make_train_step


def count_params(boxed_params) -> int:
    """Parameters excluding learned position tables (logical axis "length"), which are
    lookups with no matmul FLOPs."""
    leaves = jax.tree.leaves(boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return sum(math.prod(np.shape(x.value if isinstance(x, nn.Partitioned) else x))
               for x in leaves
               if not (isinstance(x, nn.Partitioned) and "length" in x.names))


class Trainer:
    """Holds the mesh, rules, shardings and jitted functions for one model and task.

    `setup(example_batch)` derives every sharding from the params' logical names; then
    `init_state()`, `train_step(state, batch)` (jit with in/out shardings, the state
    donated) and `eval_step(params, batch)` run under the mesh and activation rules.
    Batches passed to the jitted functions are global arrays (`global_batch`).
    """

    def __init__(self, model, task, config: TrainConfig, mesh: Optional[jax.sharding.Mesh] = None):
        self.model, self.task, self.config = model, task, config
        self.mesh = mesh if mesh is not None else parallel.make_mesh(config.mesh)
        styles = parallel.parse_parallelism(config.parallelism)
        self.rules = parallel.make_rules(*styles)
        self.activation_rules = parallel.flax_rules(parallel.make_rules(*styles, activations=True))
        self.tx, self.schedule = make_optimizer(config.optimizer, config.num_train_steps)
        self.batch_sharding = parallel.batch_sharding(self.mesh, self.rules)
        self.replicated = NamedSharding(self.mesh, P())

    @contextlib.contextmanager
    def context(self):
        """Mesh and activation rules, needed while tracing the model."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.activation_rules):
            yield

    def setup(self, example_batch: dict) -> "Trainer":
        """Derive shardings and compile lazily; `example_batch` gives per-example shapes."""
        init_batch = {k: jnp.zeros((1,) + np.shape(v)[1:], np.asarray(v).dtype)
                      for k, v in example_batch.items()}

        def init_params(rng, batch):  # batch as an argument: traced, never concrete
            return self.task.init_variables(self.model, rng, batch)["params"]

        with self.context():
            boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0), init_batch)
        self.logical_specs = parallel.logical_specs(boxed)
        params_abs = nn.unbox(boxed)
        self.param_shardings = parallel.param_shardings(boxed, self.mesh, self.rules)
        opt_abs = jax.eval_shape(self.tx.init, params_abs)
        opt_shardings = parallel.mirror_shardings(opt_abs, params_abs, self.param_shardings,
                                                  self.mesh)
        self.state_shardings = TrainState(step=self.replicated, params=self.param_shardings,
                                          opt_state=opt_shardings, rng=self.replicated)
        shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params_abs,
                            opt_state=opt_abs, rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
            self.state_shardings)
        self.num_params = count_params(boxed)

        def init_state(seed, batch):
            init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
            params = nn.unbox(init_params(init_rng, batch))
            return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=self.tx.init(params), rng=train_rng)

        self._init_batch = init_batch
        self._init = jax.jit(init_state, static_argnums=0, out_shardings=self.state_shardings)
        step_fn = make_train_step(
            self.model, self.task, self.tx, self.schedule,
            microbatches=self.config.microbatches,
            skip_nonfinite=self.config.on_nonfinite == "skip",
            microbatch_constraint=lambda mb: jax.lax.with_sharding_constraint(mb, self.batch_sharding))
        self._step = jax.jit(step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, self.replicated),
                             donate_argnums=0)
        self._eval = jax.jit(make_eval_step(self.model, self.task),
                             in_shardings=(self.param_shardings, self.batch_sharding),
                             out_shardings=self.replicated)
        return self

    def init_state(self) -> TrainState:
        with self.context():
            return self._init(self.config.seed, self._init_batch)

    def train_step(self, state: TrainState, batch: dict):
        with self.context():
            return self._step(state, batch)

    def eval_step(self, params, batch: dict) -> dict:
        with self.context():
            return self._eval(params, batch)

    def global_batch(self, local_batch: dict) -> dict:
        return parallel.global_batch(local_batch, self.batch_sharding)

    def evaluate(self, params, local_batches: Iterable[dict]) -> dict:
        """Mean of per-batch eval metrics over the given process-local batches."""
        totals, n = None, 0
        for b in local_batches:
            m = self.eval_step(params, self.global_batch(b))
            totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
            n += 1
        if not n:
            raise ValueError("evaluate: the eval iterator yielded no batches")
        return {k: float(v) / n for k, v in totals.items()}


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list            # logged train metrics dicts (with "step")
    eval_history: list
    preempted: bool          # stopped early by SIGTERM/SIGINT after saving a checkpoint
    trainer: Trainer


class _StopSignal:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step."""

    def __init__(self):
        self.received = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _check_finite(step: int, metrics: dict, checkpointer: Checkpointer, skip: bool) -> None:
    """Raise FloatingPointError for a non-finite step (unless skipping: then the step
    already left the state unchanged and its metrics show finite=0)."""
    if skip or float(metrics["finite"]) == 1.0:
        return
    good = checkpointer.all_steps()
    raise FloatingPointError(
        f"non-finite loss or gradient at step {step} (loss={float(metrics['loss'])}, "
        f"grad_norm={float(metrics['grad_norm'])}); stopped without saving. Last good "
        f"checkpoint: {good[-1] if good else 'none'} in {checkpointer.directory}. "
        "Set on_nonfinite='skip' to drop such updates instead.")


def _restore_data(iterator, data_state, skip_batches: int, logger: MetricLogger):
    if data_state is not None and hasattr(iterator, "set_state"):
        iterator.set_state(data_state)
        return
    if skip_batches:
        logger.message(f"data iterator has no saved state: skipping {skip_batches} batches")
        for _ in range(skip_batches):
            next(iterator)


def train_and_evaluate(config: TrainConfig, workdir: str, *, model, task, train_data,
                       eval_fn: Optional[Callable[[Trainer, Any, int], dict]] = None,
                       flops_per_token: Optional[Callable[[int], float]] = None,
                       mesh: Optional[jax.sharding.Mesh] = None,
                       config_dict: Optional[dict] = None) -> TrainResult:
    """Train `model` on `task` for config.num_train_steps, resuming from the latest
    checkpoint in `workdir/checkpoints` if there is one.

    train_data: iterator of process-local numpy batch dicts (this host's rows of the global
      batch); its state is checkpointed when it has get_state()/set_state(), otherwise a
      resumed run skips the batches already seen.
    eval_fn(trainer, params, step) -> metrics dict, every config.eval_every steps and at the end.
    flops_per_token(num_params) -> training FLOPs per token, for MFU.
    """
    iterator = iter(train_data)
    first = next(iterator)
    trainer = Trainer(model, task, config, mesh).setup(first)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                every=config.checkpoint_every, keep=config.keep_checkpoints,
                                async_save=config.async_checkpoint)
    if jax.process_index() == 0 and config_dict is not None:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2, default=str)
    if checkpointer.latest_step() is not None:
        state, data_state = checkpointer.restore(trainer.abstract_state)
        start = int(state.step)
        pending_first = None
    else:
        state, data_state, start = trainer.init_state(), None, 0
        pending_first = first
    logger = MetricLogger(workdir, config.num_train_steps, initial_step=start,
                          progress_bar=config.progress_bar, wandb_project=config.wandb_project,
                          config=config_dict)
    if start:
        logger.message(f"restored checkpoint at step {start} from {checkpointer.directory}")
        _restore_data(iterator, data_state, start - 1, logger)  # `first` was consumed
    tokens_per_step = task.num_tokens({k: np.zeros((config.batch_size,) + np.shape(v)[1:])
                                       for k, v in first.items()})
    fpt = flops_per_token(trainer.num_params) if flops_per_token else None
    peak = config.peak_flops_per_device or peak_flops()
    history, eval_history, preempted = [], [], False
    skip = config.on_nonfinite == "skip"
    previous = None  # (step, metrics) of the last step, checked one step late
    window_start, window_steps = time.perf_counter(), 0

    def run_eval(step):
        if eval_fn is not None:
            m = eval_fn(trainer, state.params, step)
            eval_history.append({"step": step, **m})
            logger.write(step, m, prefix="eval")

    try:
        with _StopSignal() as stop:
            for step in range(start + 1, config.num_train_steps + 1):
                local = pending_first if pending_first is not None else next(iterator)
                pending_first = None
                state, metrics = trainer.train_step(state, trainer.global_batch(local))
                if previous is not None:
                    _check_finite(*previous, checkpointer, skip)
                previous = (step, metrics)
                window_steps += 1
                logger.advance()
                if step % config.log_every == 0 or step == config.num_train_steps:
                    scalars = jax.device_get(metrics)
                    elapsed = time.perf_counter() - window_start
                    scalars["step_time"] = elapsed / window_steps
                    scalars["tokens_per_s"] = tokens_per_step * window_steps / elapsed
                    if fpt and peak:
                        scalars["mfu"] = fpt * scalars["tokens_per_s"] / (peak * jax.device_count())
                    history.append({"step": step, **{k: float(v) for k, v in scalars.items()}})
                    logger.write(step, scalars)
                    window_start, window_steps = time.perf_counter(), 0
                stopping = parallel.any_process(stop.received is not None)
                if stopping or step % max(config.checkpoint_every, 1) == 0 and config.checkpoint_every:
                    _check_finite(step, metrics, checkpointer, skip)
                    data = iterator.get_state() if hasattr(iterator, "get_state") else None
                    checkpointer.save(step, state, data, force=stopping)
                if config.eval_every and step % config.eval_every == 0:
                    run_eval(step)
                if stopping:
                    why = stop.received or "preemption signal on another process"
                    logger.message(f"{why} at step {step}: checkpoint saved, exiting")
                    preempted = True
                    break
            if previous is not None:
                _check_finite(*previous, checkpointer, skip)
            if not preempted:
                step = int(state.step)
                if config.checkpoint_every and step not in checkpointer.all_steps():
                    data = iterator.get_state() if hasattr(iterator, "get_state") else None
                    checkpointer.save(step, state, data, force=True)
                if not config.eval_every or step % config.eval_every:
                    run_eval(step)
    finally:
        checkpointer.close()
        logger.close()
    return TrainResult(state, history, eval_history, preempted, trainer)
