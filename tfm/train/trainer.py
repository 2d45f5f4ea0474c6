"""Trainer: shardings from logical rules, the jitted train step, and the training loop (which
resumes through `tfm.train.resume`)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
from typing import Any, Callable, Iterable, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm import parallel
from tfm.train.batch_checks import check_batch
from tfm.train import resume
from tfm.train.checkpoint import Checkpointer
from tfm.train.config import TrainConfig
from tfm.train.host_memory import keep_freed_buffers
from tfm.train.hooks import Hook, default_hooks
from tfm.train.metrics import MetricLogger
from tfm.train.optim import learned_norm, make_optimizer
from tfm.train.state import TrainState
from tfm.train.step import make_eval_step, make_train_step
from tfm.train.watchdog import Watchdog
from tfm.train.workdir_lock import WorkdirLock


def count_params(boxed_params, *, tied: Optional[bool] = None) -> int:
    """Parameters excluding learned position tables (logical axis "length"), which are
    lookups with no matmul FLOPs. With `tied` given (ModelConfig.tie_embeddings), every other
    lookup table (an `embedding` leaf: token types, an untied input vocabulary) is left out too,
    but not a vocabulary table tied to the output projection: the parameters a token's matmuls
    use, the N of MFU's 6·N (as MaxText and nanoGPT count it)."""
    leaves = jax.tree_util.tree_leaves_with_path(boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))

    def lookup(path, x) -> bool:
        if isinstance(x, nn.Partitioned) and "length" in x.names:
            return True
        names = [getattr(k, "key", None) for k in path]
        return tied is not None and names[-1:] == ["embedding"] and not (tied and names[-2:] == ["embed", "embedding"])
    return sum(math.prod(np.shape(x.value if isinstance(x, nn.Partitioned) else x))
               for path, x in leaves if not lookup(path, x))


class Trainer:
    """Holds the mesh, rules, shardings and jitted functions for one model and task.

    `setup(example_batch)` derives every sharding from the params' logical names; then
    `init_state()`, `train_step(state, batch)` (jit with in/out shardings, the state
    donated) and `eval_step(params, batch)` run under the mesh and activation rules.
    Batches passed to the jitted functions are global arrays (`global_batch`).
    """

    def __init__(self, model, task, config: TrainConfig, mesh: Optional[jax.sharding.Mesh] = None):
        if task.moe_aux_weight != 1.0 and not getattr(model.config, "num_experts", 0):
            raise ValueError(f"{type(task).__name__}.moe_aux_weight={task.moe_aux_weight!r} is not read: the "
                             "model has no experts (ModelConfig.num_experts=0); leave it at 1.0")
        if task.indexer_loss_weight and getattr(model.config, "indexer", None) is None:
            raise ValueError(f"{type(task).__name__}.indexer_loss_weight={task.indexer_loss_weight!r} is not read: the "
                             "model has no sparse-attention indexer (ModelConfig.indexer=None); leave it at 0")
        if task.indexer_loss_weight < 0:
            raise ValueError(f"{type(task).__name__}.indexer_loss_weight={task.indexer_loss_weight!r} must be >= 0")
        self.model, self.task, self.config = model, task, config
        self.mesh = mesh if mesh is not None else parallel.make_mesh(config.mesh)
        if self.mesh.devices.flat[0].platform == "cpu":  # steps' buffers are host memory: keep them
            keep_freed_buffers()
        styles = parallel.parse_parallelism(config.parallelism)
        self.rules = parallel.make_rules(*styles)
        self.activation_rules = parallel.flax_rules(parallel.make_rules(*styles, activations=True))
        balance = _balance_rate(model.config, task)
        self.tx, self.schedule = make_optimizer(config.optimizer, config.num_train_steps, balance_rate=balance)
        self._grad_norm = learned_norm(config.optimizer, balance)
        self.batch_sharding = parallel.batch_sharding(self.mesh, self.rules)
        self.replicated = NamedSharding(self.mesh, P())

    @contextlib.contextmanager
    def context(self):
        """Mesh, activation rules and parameter rules, needed while tracing the model."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.activation_rules), parallel.param_rules(self.rules):
            yield

    def setup(self, example_batch: dict) -> "Trainer":
        """Derive shardings and compile lazily; `example_batch` (arrays or ShapeDtypeStructs)
        gives per-example shapes. Runs nothing on the devices, so a mesh of compile-only
        devices (tfm.preflight) works too."""
        init_batch = {k: np.zeros((1,) + tuple(v.shape[1:]), v.dtype) for k, v in example_batch.items()}

        def init_params(rng, batch):  # batch as an argument: traced, never concrete
            return self.task.init_variables(self.model, rng, batch)["params"]

        with self.context():
            boxed = jax.eval_shape(init_params, jax.ShapeDtypeStruct((2,), jnp.uint32), init_batch)
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
        self.flop_params = count_params(boxed, tied=getattr(self.model.config, "tie_embeddings", None))

        def init_state(seed, batch):
            init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
            params = nn.unbox(init_params(init_rng, batch))
            return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=self.tx.init(params), rng=train_rng)

        self._init_batch = init_batch
        self.example_shapes = {k: tuple(v.shape[1:]) for k, v in example_batch.items()}  # per example
        self._init = jax.jit(init_state, static_argnums=0, out_shardings=self.state_shardings)
        step_fn = make_train_step(
            self.model, self.task, self.tx, self.schedule,
            microbatches=self.config.microbatches,
            skip_nonfinite=self.config.on_nonfinite == "skip",
            microbatch_constraint=lambda mb: jax.lax.with_sharding_constraint(mb, self.batch_sharding),
            norm=self._grad_norm)
        self._step = jax.jit(step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, self.replicated),
                             donate_argnums=0)
        self._eval = jax.jit(make_eval_step(self.model, self.task),
                             in_shardings=(self.param_shardings, self.batch_sharding),
                             out_shardings=self.replicated)
        return self

    @property
    def jitted_train_step(self):
        """The `jax.jit` train step `train_step` runs (state donated): trace, lower or compile it
        ahead of time under `context()`, e.g. `.trace(abstract_state, batch).lower().compile()`."""
        return self._step

    @property
    def jitted_eval_step(self):
        """The `jax.jit` eval step `eval_step` runs, `(params, batch) -> (metrics, weight)`; as
        `jitted_train_step`."""
        return self._eval

    def init_state(self) -> TrainState:
        with self.context():
            return self._init(self.config.seed, self._init_batch)

    def train_step(self, state: TrainState, batch: dict):
        with self.context():
            return self._step(state, batch)

    def eval_step(self, params, batch: dict) -> tuple[dict, jax.Array]:
        with self.context():
            return self._eval(params, batch)

    def global_batch(self, local_batch: dict) -> dict:
        """This process's rows, checked (ids inside their ranges, naming any that is not), as
        one global array per key."""
        check_batch(self.task, local_batch, self.model.config)
        return parallel.global_batch(local_batch, self.batch_sharding)

    def evaluate(self, params, local_batches: Iterable[dict]) -> dict:
        """Eval metrics over the given process-local batches, each batch's means weighted by
        its count of the task's first loss term (target tokens), so padding does not skew them."""
        totals, weight = None, 0.0
        for b in local_batches:
            m, w = self.eval_step(params, self.global_batch(b))
            m = jax.tree.map(lambda x: x * w, m)
            totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
            weight += w
        if totals is None:
            raise ValueError("evaluate: the eval iterator yielded no batches")
        return {k: float(v) / float(weight) for k, v in totals.items()}


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list            # logged train metrics dicts (with "step")
    eval_history: list
    preempted: bool          # stopped early by SIGTERM/SIGINT after saving a checkpoint
    trainer: Trainer


class DevicePrefetch:
    """Global (on-device) batches, put `ahead` steps before the loop asks for them: a step
    whose input transfer was only just issued would wait for it at dispatch. Keeps the data
    iterator's state after each batch, so a checkpoint records exactly the batches trained on."""

    def __init__(self, local_batches: Iterator[dict], iterator, to_global: Callable, ahead: int = 2):
        self.local, self.iterator, self.to_global, self.ahead = local_batches, iterator, to_global, ahead
        self.queue = collections.deque()
        self.state = self._iterator_state()

    def _iterator_state(self):
        return self.iterator.get_state() if hasattr(self.iterator, "get_state") else None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while len(self.queue) <= self.ahead:
            try:
                local = next(self.local)
            except StopIteration:
                break
            self.queue.append((self.to_global(local), self._iterator_state()))
        if not self.queue:
            raise StopIteration
        batch, self.state = self.queue.popleft()
        return batch


@dataclasses.dataclass
class Run:
    """What the loop and its hooks share (see tfm.train.hooks)."""
    config: TrainConfig
    workdir: str
    trainer: Trainer
    checkpointer: Checkpointer
    logger: MetricLogger
    batches: DevicePrefetch     # global batches still to train on
    state: TrainState
    step: int                   # steps done so far
    stop_reason: Optional[str] = None
    history: list = dataclasses.field(default_factory=list)
    eval_history: list = dataclasses.field(default_factory=list)
    watchdog: Watchdog = dataclasses.field(default_factory=Watchdog)  # told the step and phase (save, eval)

    def data_state(self):
        """The data iterator's state after the last batch trained on (None: it has none)."""
        return self.batches.state

    def roll_back(self, step: int, skip: int) -> None:
        """Back to the checkpoint of `step`: its train state, and the data stream at its position
        with the next `skip` batches dropped, which the checkpoint's data state then records (a
        resume from it drops them too); the metrics after `step` are forgotten."""
        self.state, data_state = self.checkpointer.restore(self.trainer.abstract_state, step)
        iterator = self.batches.iterator
        iterator.set_state(data_state)
        for _ in range(skip):
            next(iterator)
        self.checkpointer.rewrite_data_state(step, iterator.get_state())
        self.batches = DevicePrefetch(iterator, iterator, self.trainer.global_batch)
        self.step = step
        self.history[:] = [h for h in self.history if h["step"] <= step]
        self.eval_history[:] = [h for h in self.eval_history if h["step"] <= step]
        self.logger.rewind(step)

    def close(self, quiet: bool = False) -> None:
        """Waits for background saves (raising if one failed, unless `quiet`); closes the logs."""
        try:
            self.checkpointer.close()
        except Exception:  # noqa: BLE001 - an error is already on its way up when quiet
            if not quiet:
                raise
        finally:
            self.logger.close()


def _checkpointer(config: TrainConfig, workdir: str) -> Checkpointer:
    return Checkpointer(os.path.join(workdir, "checkpoints"), every=config.checkpoint_every,
                        keep=config.keep_checkpoints, async_save=config.async_checkpoint)


def _logger(config: TrainConfig, workdir: str, *, start: int, config_dict: Optional[dict]) -> MetricLogger:
    """metrics.jsonl (and the progress bar, wandb) continuing after `start` steps."""
    return MetricLogger(workdir, config.num_train_steps, initial_step=start, progress_bar=config.progress_bar,
                        wandb_project=config.wandb_project, config=config_dict)


def _previous_histories(logger: MetricLogger) -> tuple[list, list]:
    """(train, eval) records of earlier runs in this workdir, for the result's histories."""
    previous = {"train": [], "eval": []}
    for record in logger.previous:
        if record["split"] in previous:  # not events ("recovery")
            previous[record["split"]].append({k: v for k, v in record.items() if k != "split"})
    return previous["train"], previous["eval"]


def _start_run(config: TrainConfig, workdir: str, *, model, task, train_data, mesh: Optional[jax.sharding.Mesh],
            config_dict: Optional[dict]) -> Run:
    """Trainer set up from the first batch; state restored from the latest checkpoint or
    initialised; the config recorded (after the restore check, so a refused run changes nothing)."""
    iterator = iter(train_data)
    first = next(iterator)
    trainer = Trainer(model, task, config, mesh).setup(first)
    checkpointer = _checkpointer(config, workdir)
    record, changes = resume.changes_since_record(workdir, config_dict)
    notes = []  # said once the logger exists
    state, data_state = resume.initial_state(trainer, checkpointer, fallback=config.fallback_to_older,
                                             record=record, changes=changes, say=notes.append)
    start = int(state.step)
    logger = _logger(config, workdir, start=start, config_dict=config_dict)
    for note in notes:
        logger.message(note)
    resume.record_config(workdir, config_dict, start=start, changes=changes, say=logger.message)
    if start:
        logger.message(f"restored checkpoint at step {start} from {checkpointer.directory}")
    batches = resume.skip_trained(iterator, first=first, data_state=data_state, start=start, say=logger.message)
    history, eval_history = _previous_histories(logger)
    return Run(config=config, workdir=workdir, trainer=trainer, checkpointer=checkpointer, logger=logger,
               batches=DevicePrefetch(batches, iterator, trainer.global_batch), state=state, step=start,
               history=history, eval_history=eval_history, watchdog=Watchdog.from_config(config))


def train_and_evaluate(config: TrainConfig, workdir: str, *, model, task, train_data,
                       eval_data: Optional[Callable[[], Iterable[dict]]] = None,
                       eval_extra: Optional[Callable[[Trainer, Any, int], dict]] = None,
                       flops_per_token: Optional[Callable[[int], float]] = None,
                       hooks: Optional[Callable[[list[Hook]], list[Hook]]] = None,
                       mesh: Optional[jax.sharding.Mesh] = None,
                       config_dict: Optional[dict] = None) -> TrainResult:
    """Train `model` on `task` for config.num_train_steps, resuming from the latest
    checkpoint in `workdir/checkpoints` if there is one.

    train_data: iterator of process-local numpy batch dicts (this host's rows of the global
      batch); its state is checkpointed when it has get_state()/set_state(), otherwise a
      resumed run skips the batches already seen.
    eval_data() -> a fresh iterable of process-local eval batches; eval_extra(trainer, params,
      step) -> more eval metrics (BLEU, ...). Both every config.eval_every steps and at the end.
    flops_per_token(flop_params) -> training FLOPs per token, for MFU, from the trainer's
      `flop_params` (`count_params`: the parameters a token's matmuls use).
    hooks(default_hooks) -> the hook list to use (add to it, reorder, replace).
    config_dict: the resolved config, recorded in workdir/config.json.
    """
    with WorkdirLock(workdir):
        run = _start_run(config, workdir, model=model, task=task, train_data=train_data, mesh=mesh,
                      config_dict=config_dict)
        shapes = {k: np.zeros((config.batch_size,) + shape) for k, shape in run.trainer.example_shapes.items()}
        fpt = flops_per_token(run.trainer.flop_params) if flops_per_token else None
        all_hooks = default_hooks(config, tokens_per_step=task.num_tokens(shapes), flops_per_token=fpt,
                                  eval_data=eval_data, eval_extra=eval_extra)
        all_hooks = hooks(all_hooks) if hooks else all_hooks
        try:
            for hook in all_hooks:
                hook.start(run)
            run.watchdog.start(run.step)
            phase = "compile"  # this process's first step
            while run.step < config.num_train_steps and not run.stop_reason:
                run.watchdog.enter(run.step + 1, "data")
                batch = next(run.batches)
                run.watchdog.enter(run.step + 1, phase)
                run.state, metrics = run.trainer.train_step(run.state, batch)
                run.watchdog.dispatched(metrics["loss"])
                phase = "step"
                run.step += 1
                step = run.step
                for hook in all_hooks:
                    hook.after_step(run, step, metrics)
                    if run.step != step:  # rolled back (a loss spike): the hooks after it skip this step
                        break
            run.watchdog.enter(run.step, "finish")
            for hook in all_hooks:
                hook.end(run)
        except BaseException:
            run.watchdog.settle()
            run.close(quiet=True)
            raise
        finally:
            run.watchdog.stop()
            for hook in all_hooks:
                hook.close()
        run.close()
    return TrainResult(run.state, run.history, run.eval_history, bool(run.stop_reason), run.trainer)


def _balance_rate(cfg, task):
    """ModelConfig.router_bias_rate when the model's routers carry DeepSeek's balancing bias, else None."""
    if not (getattr(cfg, "num_experts", 0) and getattr(cfg, "router_bias", False)):
        return None
    if task.moe_aux_weight <= 0:
        raise ValueError(f"{type(task).__name__}.moe_aux_weight={task.moe_aux_weight!r}: the routers' balancing "
                         "bias (ModelConfig.router_bias) learns its update through the sown losses; keep it > 0")
    return cfg.router_bias_rate
