"""What the training loop does besides stepping, each a small hook object.

The loop (`tfm.train.trainer.train_and_evaluate`) calls, in list order, `start(run)` once
after restoring, `after_step(run, step, metrics)` after dispatching each step, and
`end(run)` once after the last step (also after a preemption stop, never after an
exception); `close()` always. `run` is the shared `tfm.train.trainer.Run`. A hook sets
`run.stop_reason` to end the loop after the current step. `default_hooks` builds the list
from a TrainConfig; `train_and_evaluate(..., hooks=lambda defaults: [...])` adds to it or
replaces parts of it.

Nothing here reads a step's results on the host in the step it was dispatched, except
where it must (logging, saving, evaluating), so the host runs ahead of the devices.
"""
from __future__ import annotations

import collections
import json
import math
import os
import signal
import time
from typing import Callable, Iterable, Optional

import jax
import numpy as np

from tfm import parallel
from tfm.train.checkpoint import Checkpointer, CheckpointError
from tfm.train.metrics import peak_flops
from tfm.train.replicas import ReplicaChecksums, ReplicaMismatchError


class Hook:
    def start(self, run) -> None:
        pass

    def after_step(self, run, step: int, metrics: dict) -> None:
        pass

    def end(self, run) -> None:
        pass

    def close(self) -> None:
        pass


class LaggedCheck(Hook):
    """Settles each step's metrics `lag` steps late, so the host never waits on the step it just
    dispatched; `check(run, step)` settles every step up to `step` (the checkpoint hook calls it
    before saving, so no state that fails the check is saved). A subclass's `settle(run, step,
    metrics)` judges one step; it returns True when it rolled the run back (the later steps undone)."""

    def __init__(self, lag: int = 2):
        self.lag, self.pending = lag, collections.deque()

    def after_step(self, run, step, metrics):
        self.pending.append((step, metrics))
        self.check(run, step - self.lag)

    def check(self, run, upto: float) -> None:
        while self.pending and self.pending[0][0] <= upto:
            if self.settle(run, *self.pending.popleft()):
                return

    def settle(self, run, step: int, metrics: dict) -> bool:
        raise NotImplementedError


class NonFiniteCheck(LaggedCheck):
    """Raises FloatingPointError naming the first step whose loss or gradient was not finite."""

    def settle(self, run, step, m):
        if float(m["finite"]) != 1.0:
            good = run.checkpointer.all_steps()
            raise FloatingPointError(
                f"non-finite loss or gradient at step {step} (loss={float(m['loss'])}, "
                f"grad_norm={float(m['grad_norm'])}); stopped without saving. Last good "
                f"checkpoint: {good[-1] if good else 'none'} in {run.checkpointer.directory}. "
                "Set on_nonfinite='skip' to drop such updates instead.")
        return False

    def end(self, run):
        self.check(run, math.inf)


class LossSpikeError(FloatingPointError):
    """Loss spikes that rolling back and skipping batches did not cure, or a spike with nothing to roll back to."""


class SpikeRecovery(LaggedCheck):
    """A loss above `factor` x the median of the last `window` losses (once that many are in), or a
    non-finite loss or gradient (`nonfinite`: with on_nonfinite="stop", in place of NonFiniteCheck),
    rolls the run back to the newest checkpoint before that step and skips the `skip` batches of
    the stream after it (`Run.roll_back`: the checkpoint's data state says so, a "recovery"
    record in metrics.jsonl too). A spike beyond `max_recoveries` recoveries within `period`
    steps raises LossSpikeError in one line. Losses are read `lag` steps late (the last step's at
    once); `check(run, step)` settles every step up to `step`, as the checkpoint hook asks before
    saving, so no spiked state is saved. The window and the count start afresh in each process."""

    def __init__(self, factor: float, window: int, skip: int, max_recoveries: int, period: int,
                 nonfinite: bool, lag: int = 2):
        super().__init__(lag)
        self.factor, self.skip, self.max_recoveries, self.period = factor, skip, max_recoveries, period
        self.nonfinite, self.losses, self.recoveries = nonfinite, collections.deque(maxlen=window), []

    def start(self, run):
        if not hasattr(run.batches.iterator, "set_state"):
            raise ValueError("TrainConfig.spike_factor needs a data iterator with get_state()/set_state() "
                             "(to roll the stream back to a checkpoint); this one has none: leave spike_factor None")

    def after_step(self, run, step, metrics):
        self.pending.append((step, metrics))
        self.check(run, step if step == run.config.num_train_steps else step - self.lag)

    def settle(self, run, step, m):
        loss, finite = float(m["loss"]), float(m["finite"]) == 1.0
        if not finite and not self.nonfinite:
            return False  # on_nonfinite="skip": the step dropped the update itself
        full = len(self.losses) == self.losses.maxlen
        median = float(np.median(self.losses)) if full else math.nan
        if finite and not (full and loss > self.factor * median):
            self.losses.append(loss)
            return False
        self._recover(run, step, loss, median, finite)
        return True

    def _recover(self, run, step: int, loss: float, median: float, finite: bool) -> None:
        what = (f"loss spike at step {step} (loss {loss:.4g} > {self.factor:g} x the running median {median:.4g})"
                if finite else f"non-finite loss or gradient at step {step} (loss {loss:.4g})")
        run.checkpointer.wait()  # a save still in flight may be the newest before the spike
        earlier = [s for s in run.checkpointer.all_steps() if s < step]
        if not earlier:
            raise LossSpikeError(f"{what} and no checkpoint before it to roll back to; stopped. Checkpoints come "
                                 f"every {run.config.checkpoint_every} steps (checkpoint_every)")
        self.recoveries = [s for s in self.recoveries if s > step - self.period]
        if len(self.recoveries) >= self.max_recoveries:
            raise LossSpikeError(
                f"{what}: {len(self.recoveries) + 1} spikes within {self.period} steps, more than "
                f"spike_max_recoveries={self.max_recoveries} (spike_recovery_window={self.period}); stopped. Last "
                f"good checkpoint: {earlier[-1]} in {run.checkpointer.directory}. Skip more of the stream "
                "(spike_skip_batches) or lower the learning rate, then run the same command")
        self.recoveries.append(step)
        self.pending.clear()  # the steps after `step` are undone too
        back = earlier[-1]
        run.roll_back(back, self.skip)
        run.logger.event(back, "recovery", {"spike_step": step, "loss": loss, "median": median,
                                            "skipped_batches": self.skip},
                         f"{what}: rolled back to the checkpoint of step {back} and skipped the {self.skip} "
                         f"batches after it (recovery {len(self.recoveries)} of at most {self.max_recoveries} "
                         f"within {self.period} steps)")


class ReplicaCheck(Hook):
    """Every `every` steps, and before each save (Checkpointing calls `check`), the data-parallel
    replicas compare checksums of their parameters (tfm.train.replicas); a mismatch raises
    ReplicaMismatchError naming the replica and the step, so nothing they disagree on is saved."""

    def __init__(self, every: int):
        self.every, self.checksums, self.agreed = every, None, None

    def start(self, run):
        self.checksums = ReplicaChecksums(run.trainer.mesh, run.trainer.param_shardings)

    def after_step(self, run, step, metrics):
        if step % self.every == 0:
            self.check(run, step)

    def check(self, run, step: int) -> None:
        if self.agreed == step:
            return
        bad = self.checksums.disagreements(self.checksums.table(run.state.params))
        if bad:
            good = run.checkpointer.all_steps()
            raise ReplicaMismatchError(
                f"at step {step}, {self.checksums.describe(bad)} (replica_check_every={self.every}, last agreement "
                f"at step {self.agreed if self.agreed is not None else 'none'}); stopped before saving. Last good "
                f"checkpoint: {good[-1] if good else 'none'} in {run.checkpointer.directory}. A device that computes "
                "wrong values: take its host out of the job, then run the same command to resume from that checkpoint")
        self.agreed = step


class MetricsLog(Hook):
    """Every `every` steps and at the last: train metrics, step time, tokens/s and MFU."""

    def __init__(self, every: int, tokens_per_step: int, flops_per_token: Optional[float] = None,
                 peak_flops_per_device: Optional[float] = None):
        self.every, self.tokens_per_step, self.flops_per_token = every, tokens_per_step, flops_per_token
        self.peak = peak_flops_per_device or peak_flops()

    def start(self, run):
        self.window_start, self.window_steps = time.perf_counter(), 0

    def after_step(self, run, step, metrics):
        self.window_steps += 1
        run.logger.advance()
        if step % self.every and step != run.config.num_train_steps:
            return
        scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
        elapsed = time.perf_counter() - self.window_start
        scalars["step_time"] = elapsed / self.window_steps
        scalars["tokens_per_s"] = self.tokens_per_step * self.window_steps / elapsed
        if self.flops_per_token and self.peak:
            scalars["mfu"] = self.flops_per_token * scalars["tokens_per_s"] / (self.peak * jax.device_count())
        run.history.append({"step": step, **scalars})
        run.logger.write(step, scalars)
        self.window_start, self.window_steps = time.perf_counter(), 0


class Preemption(Hook):
    """SIGTERM/SIGINT stop the run after the current step with a checkpoint of it.

    One process reads its own flag every step. With several processes they agree every
    `check_every` steps (one tiny all-gather, the only host sync it adds), so a signal on
    one host makes every host stop after the same step."""

    def __init__(self, check_every: int = 10):
        self.check_every, self.received, self.previous = check_every, None, {}

    def start(self, run):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def after_step(self, run, step, metrics):
        if jax.process_count() > 1:
            if step % self.check_every or not parallel.any_process(self.received is not None):
                return
        elif self.received is None:
            return
        run.stop_reason = self.received or "preemption signal on another process"

    def end(self, run):
        if run.stop_reason:
            run.logger.message(f"{run.stop_reason} at step {run.step}: checkpoint saved, exiting")

    def close(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


class Checkpointing(Hook):
    """Saves every `run.checkpointer.every` steps (0: never), at a stop, and after the last step
    (always, so a finished run's final state is on disk for evaluation and resuming);
    each of `guards` (NonFiniteCheck, ReplicaCheck) first settles the state to save (`check(run, step)`). A background
    save that failed is reported at the first step after it failed (at the latest before the
    next save, which waits for it), naming it and the last good checkpoint."""

    def __init__(self, *guards):
        self.guards, self.saving = guards, None

    def _save(self, run, step, force):
        with run.watchdog.phase(step, "save"):
            for guard in self.guards:
                guard.check(run, step)
            if run.step != step:  # a guard rolled the run back (SpikeRecovery): `step` is undone
                return
            self._check_background(run, step, wait=True)  # the previous save, finished by now as a rule
            try:
                run.checkpointer.save(step, run.state, run.data_state(), force=force)
            except Exception as e:  # noqa: BLE001 - whatever the writer raised
                self.saving = step
                raise self._failure(run, step, e) from e
            self.saving = step

    def _check_background(self, run, step, wait=False):
        try:
            run.checkpointer.check_background_save(wait)
        except CheckpointError as e:
            raise self._failure(run, step, e.__cause__) from e

    def _failure(self, run, step, cause) -> CheckpointError:
        checkpointer = run.checkpointer
        checkpointer.discard_partial(self.saving)
        good = [s for s in checkpointer.all_steps() if s != self.saving and (checkpointer.directory / str(s)).exists()]
        last = f"Last good checkpoint: {good[-1] if good else 'none'} in {checkpointer.directory}"
        full = checkpointer.out_of_space(cause)
        if full:
            return CheckpointError(f"at step {step}: the checkpoint of step {self.saving} did not fit: {full}; "
                                   f"training stopped. {last}. Free space there and run the same command: it "
                                   f"resumes from that checkpoint")
        return CheckpointError(
            f"at step {step}: saving the checkpoint of step {self.saving} failed ({type(cause).__name__}: "
            f"{cause}); training stopped. {last}")

    def after_step(self, run, step, metrics):
        self._check_background(run, step)
        every = run.checkpointer.every
        if run.stop_reason or (every and step % every == 0):
            self._save(run, step, force=bool(run.stop_reason))

    def end(self, run):
        if not run.stop_reason and run.step not in run.checkpointer.all_steps():
            self._save(run, run.step, force=True)
        self._check_background(run, run.step, wait=True)


class Evaluation(Hook):
    """Every `every` steps (0: never) and after the last step: the task's eval metrics on
    `eval_data()` (process-local batches, sharded and jitted like training) plus `extra(trainer,
    params, step)` (e.g. BLEU), logged under "eval"; each result goes to `best` if given."""

    def __init__(self, every: int, eval_data: Optional[Callable[[], Iterable[dict]]] = None,
                 extra: Optional[Callable] = None, best: Optional["BestCheckpoint"] = None):
        self.every, self.eval_data, self.extra, self.best, self.done = every, eval_data, extra, best, set()

    def start(self, run):
        if self.best:
            self.best.start(run)

    def after_step(self, run, step, metrics):
        if self.every and step % self.every == 0:
            self.evaluate(run, step)

    def end(self, run):
        # the final step may have been evaluated by an earlier run (in process 0's records)
        evaluated = run.step in self.done | {e["step"] for e in run.eval_history}
        if not run.stop_reason and not parallel.from_process_0(evaluated):
            self.evaluate(run, run.step)

    def evaluate(self, run, step: int) -> dict:
        params = run.state.params
        with run.watchdog.phase(step, "eval"):
            m = run.trainer.evaluate(params, self.eval_data()) if self.eval_data else {}
            m.update(self.extra(run.trainer, params, step) if self.extra else {})
        run.eval_history.append({"step": step, **m})
        run.logger.write(step, m, prefix="eval")
        self.done.add(step)
        if self.best:
            self.best.consider(run, step, m)
        return m

    def close(self):
        if self.best:
            self.best.close()


class BestCheckpoint:
    """Keeps the state with the best value so far of eval metric `metric` ("max" or "min"
    `mode`) in <workdir>/best, and best.json saying which step and value; survives resumes."""

    def __init__(self, metric: str, mode: str = "max"):
        self.metric, self.sign, self.value, self.checkpointer = metric, 1.0 if mode == "max" else -1.0, None, None

    def start(self, run):
        directory = os.path.join(run.workdir, "best")
        self.checkpointer = Checkpointer(directory, every=1, keep=1, async_save=False)
        self.record = os.path.join(directory, "best.json")
        if os.path.exists(self.record):
            with open(self.record) as f:
                self.value = json.load(f)["value"]

    def consider(self, run, step: int, metrics: dict) -> None:
        if self.metric not in metrics:
            raise KeyError(f"keep_best={self.metric!r} is not an eval metric; have {sorted(metrics)}")
        value = float(metrics[self.metric])
        if self.value is not None and not self.sign * value > self.sign * self.value:
            return
        self.value = value
        self.checkpointer.save(step, run.state, force=True)
        if jax.process_index() == 0:
            with open(self.record, "w") as f:
                json.dump({"metric": self.metric, "value": value, "step": step}, f)
        run.logger.message(f"step {step}: new best {self.metric}={value:.4g}, kept in {os.path.dirname(self.record)}")

    def close(self):
        if self.checkpointer is not None:
            self.checkpointer.close()


def default_hooks(config, *, tokens_per_step: int, flops_per_token: Optional[float] = None,
                  eval_data=None, eval_extra=None) -> list[Hook]:
    """NaN check (or spike recovery), replica agreement, metrics, preemption, checkpointing and evaluation, in that order."""
    if config.spike_factor is not None:
        guards = [SpikeRecovery(config.spike_factor, config.spike_window,
                                config.spike_skip_batches or config.checkpoint_every, config.spike_max_recoveries,
                                config.spike_recovery_window, nonfinite=config.on_nonfinite == "stop")]
    else:
        guards = [NonFiniteCheck()] if config.on_nonfinite == "stop" else []
    guards += [ReplicaCheck(config.replica_check_every)] if config.replica_check_every else []
    hooks = guards + [MetricsLog(config.log_every, tokens_per_step, flops_per_token, config.peak_flops_per_device),
                      Preemption(config.preemption_check_every), Checkpointing(*guards)]
    if eval_data is not None or eval_extra is not None:
        best = BestCheckpoint(config.keep_best, config.keep_best_mode) if config.keep_best else None
        hooks.append(Evaluation(config.eval_every, eval_data, eval_extra, best))
    elif config.keep_best:
        raise ValueError(f"TrainConfig.keep_best={config.keep_best!r} needs an evaluation "
                         "(eval_data or eval_extra)")
    return hooks
