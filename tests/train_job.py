"""A tiny, deterministic training job for the fault and multi-host tests (run as a script
or imported). Data: a stateful iterator over a fixed random LM token array, so a resumed
run sees exactly the batches an uninterrupted one would.

python tests/train_job.py --workdir W --steps 12 [--sleep 0.2] [--slow] [--multihost I]
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time

import numpy as np

BATCH, LENGTH, VOCAB = 8, 16, 64


class TokenBatches:
    """Process-local LM batches from a seeded array; get_state/set_state = batch index."""

    def __init__(self, process_index=0, process_count=1, sleep=0.0, nan_at=None):
        rng = np.random.default_rng(1234)
        self.tokens = rng.integers(1, VOCAB, (64, BATCH, LENGTH + 1)).astype(np.int32)
        rows = BATCH // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)
        self.index, self.sleep, self.nan_at = 0, sleep, nan_at

    def __iter__(self):
        return self

    def batch_tokens(self, index: int) -> np.ndarray:
        """[BATCH, LENGTH + 1] tokens of stream batch `index` (every process's rows)."""
        return self.tokens[index % len(self.tokens)]

    def __next__(self):
        time.sleep(self.sleep)
        t = self.batch_tokens(self.index)[self.rows]
        weights = np.ones(t[:, 1:].shape, np.float32)
        if self.nan_at is not None and self.index + 1 == self.nan_at:
            weights[0, 0] = np.nan
        self.index += 1
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": weights}

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


class PatternBatches(TokenBatches):
    """A generated corpus a model learns in a few steps: rows of tokens 1..`symbols`, each the image of
    the one before under a fixed permutation, from a random first token (batch `index` from its own
    seed). The batches whose index is in `poison` (a stretch of bad data) follow another permutation."""

    def __init__(self, process_index=0, process_count=1, *, seed=0, poison=range(0), symbols=8):
        super().__init__(process_index, process_count)
        self.seed, self.poison, self.symbols = seed, poison, symbols
        perms = np.random.default_rng(7).permuted(np.tile(np.arange(1, symbols + 1), (2, 1)), axis=1)
        self.next_token = np.zeros((2, symbols + 1), np.int32)
        self.next_token[:, 1:] = perms

    def batch_tokens(self, index):
        rng = np.random.default_rng((self.seed, index))
        table = self.next_token[int(index in self.poison)]
        t = np.zeros((BATCH, LENGTH + 1), np.int32)
        t[:, 0] = rng.integers(1, self.symbols + 1, BATCH)
        for i in range(LENGTH):
            t[:, i + 1] = table[t[:, i]]
        return t


def held_out(process_index=0, process_count=1, batches=2):
    """() -> the first `batches` batches of a PatternBatches stream of another seed (clean)."""
    return lambda: [b for b, _ in zip(PatternBatches(process_index, process_count, seed=99), range(batches))]


def config(steps, *, mesh=(("data", 2), ("fsdp", 4)), checkpoint_every=2, on_nonfinite="stop",
           async_checkpoint=True, log_every=1, learning_rate=1e-2, **fields):
    from tfm.parallel import MeshConfig
    from tfm.train import OptimizerConfig, TrainConfig
    return TrainConfig(num_train_steps=steps, batch_size=BATCH, mesh=MeshConfig(**dict(mesh)),
                       parallelism="data+fsdp", optimizer=OptimizerConfig(learning_rate=learning_rate),
                       log_every=log_every, checkpoint_every=checkpoint_every, keep_checkpoints=2,
                       async_checkpoint=async_checkpoint, progress_bar=False,
                       on_nonfinite=on_nonfinite, **fields)


def run(workdir, steps, *, data=None, task=None, hooks=None, eval_data=None, **kw):
    from tfm.models import DecoderLM
    from tfm.models.presets import tiny
    from tfm.train import LMTask, train_and_evaluate
    return train_and_evaluate(config(steps, **kw), workdir, model=DecoderLM(tiny("decoder")),
                              task=task or LMTask(), train_data=data or TokenBatches(), hooks=hooks,
                              eval_data=eval_data)


def slow_task():
    """LMTask whose step also runs ~100 ms of matmuls, so the device is the bottleneck."""
    import jax
    import jax.numpy as jnp
    from tfm.train import LMTask

    class SlowLMTask(LMTask):
        def loss(self, *args, **kwargs):
            objective, metrics = super().loss(*args, **kwargs)
            x = jnp.full((256, 256), 1e-3) * jax.lax.stop_gradient(objective)
            x = jax.lax.fori_loop(0, 12, lambda i, x: jnp.tanh(x @ x), x)
            return objective + 1e-30 * jnp.mean(x), metrics

    return SlowLMTask()


def limit_file_size_at(at_step: int):
    """A hook that, after `at_step` (its pending save finished), caps file sizes at 16 kB."""
    import resource
    import signal
    from tfm.train import Hook

    class LimitFileSize(Hook):
        def after_step(self, run, step, metrics):
            if step == at_step:
                run.checkpointer.wait()
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

    return LimitFileSize()


def corrupt_replica(replica: int, at_step: int):
    """A hook that, after `at_step`, adds 1e-3 to the first parameter's copy on the devices of
    data-parallel replica `replica` (what a core computing wrong values leaves behind)."""
    import jax
    from tfm.train import Hook

    class Corrupt(Hook):
        def after_step(self, run, step, metrics):
            if step != at_step:
                return
            leaves, tree = jax.tree.flatten(run.state.params)
            x = leaves[0]
            mesh = x.sharding.mesh
            data = list(mesh.axis_names).index("data")
            position = {d: np.unravel_index(i, mesh.devices.shape)[data] for i, d in enumerate(mesh.devices.flat)}
            blocks = [s.data + 1e-3 if position[s.device] == replica else s.data for s in x.addressable_shards]
            leaves[0] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, blocks)
            run.state = run.state.replace(params=jax.tree.unflatten(tree, leaves))

    return Corrupt()


def hang(process: int, at_step: int):
    """A hook (put first) that blocks process `process` for good inside step `at_step`, after saying so,
    while its other threads (the heartbeat) go on: a main thread stuck as on a read that never returns."""
    import jax
    from tfm.train import Hook

    class Hang(Hook):
        def after_step(self, run, step, metrics):
            if step == at_step and jax.process_index() == process:
                print(f"hanging in step {step}", flush=True)
                time.sleep(3600)

    return Hang()


def sync_every_step():
    """A hook that agrees across processes after every step (what the loop must not do)."""
    from tfm import parallel
    from tfm.train import Hook

    class Agree(Hook):
        def after_step(self, run, step, metrics):
            parallel.any_process(False)

    return Agree()


def dispatch_probe():
    """A hook (put first) that, right after each dispatch, counts the steps whose results are
    not ready yet (3: the host is two steps ahead of the device), and wraps this step's
    metrics so that every host read of them is logged as (step being run, step read)."""
    import numpy as np
    from tfm.train import Hook

    class Recorded:
        def __init__(self, value, step, probe):
            self.value, self.step, self.probe = value, step, probe

        def _read(self):
            self.probe.reads.append((self.probe.step, self.step))
            return np.asarray(self.value)

        def __float__(self):
            return float(self._read())

        def __array__(self, dtype=None, copy=None):
            return self._read().astype(dtype) if dtype else self._read()

    class InFlight(Hook):
        def __init__(self):
            self.outputs, self.counts, self.reads, self.step = [], [], [], 0

        def after_step(self, run, step, metrics):
            self.step = step
            self.outputs.append(metrics["loss"])
            self.counts.append(sum(not x.is_ready() for x in self.outputs[-4:]))
            for k, v in metrics.items():
                metrics[k] = Recorded(v, step, self)

        @property
        def most(self):
            return max(self.counts)

    return InFlight()


def flat_params(state) -> dict:
    import jax
    from jax.experimental import multihost_utils
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for p, x in leaves}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--slow", action="store_true", help="device-bound steps; record the dispatch lead")
    p.add_argument("--sync_each_step", action="store_true", help="with --slow: a hook that all-gathers "
                   "a flag after every step, as the preemption agreement once did (the control)")
    p.add_argument("--fsize_limit_at", type=int, default=None,
                   help="after this step, files may not grow past 16 kB (the next checkpoint fails)")
    p.add_argument("--pattern", action="store_true", help="train on PatternBatches, evaluate on held-out ones")
    p.add_argument("--poison", default=None, help="A:B: with --pattern, stream batches A..B-1 are poisoned")
    p.add_argument("--corrupt_replica", default=None, help="R:S: after step S, replica R's first parameter "
                   "is changed (corrupt_replica)")
    p.add_argument("--hang", default=None, help="P:S: process P blocks inside step S (hang)")
    p.add_argument("--set", action="append", default=[], help="TrainConfig FIELD=VALUE (a Python "
                   "literal; learning_rate too)")
    p.add_argument("--multihost", type=int, default=None, help="process id of 2")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pid, count = 0, 1
    if a.multihost is not None:
        from tfm.parallel import initialize
        initialize(f"127.0.0.1:{a.port}", num_processes=2, process_id=a.multihost)
        pid, count = a.multihost, 2
    import jax
    probe = dispatch_probe() if a.slow else None
    extra = [sync_every_step()] if a.sync_each_step else []
    slow = dict(task=slow_task(), hooks=lambda hooks: [probe, *extra, *hooks], log_every=100,
                checkpoint_every=0) if a.slow else {}
    if a.fsize_limit_at:
        limit = limit_file_size_at(a.fsize_limit_at)
        slow = dict(hooks=lambda hooks: [*hooks, limit])
    if a.corrupt_replica:
        corrupt = corrupt_replica(*map(int, a.corrupt_replica.split(":")))
        slow = dict(hooks=lambda hooks: [*hooks, corrupt])
    if a.hang:
        stuck = hang(*map(int, a.hang.split(":")))
        slow = dict(hooks=lambda hooks: [stuck, *hooks])
    fields = {k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in a.set)}
    if "mesh" in fields:
        fields["mesh"] = tuple(fields["mesh"].items())
    data = TokenBatches(pid, count, sleep=a.sleep)
    if a.pattern:
        poison = range(*map(int, a.poison.split(":"))) if a.poison else range(0)
        data, fields["eval_data"] = PatternBatches(pid, count, poison=poison), held_out(pid, count)
    try:
        result = run(a.workdir, a.steps, data=data, **slow, **fields)
    except FloatingPointError as e:  # the run's faults (spikes, replicas): one line, as experiments.common.fail
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        sys.stderr.flush()
        os._exit(1)
    params = flat_params(result.state)
    out = {"losses": [h["loss"] for h in result.history], "preempted": result.preempted,
           "eval_loss": result.eval_history[-1]["loss"] if result.eval_history else None,
           "step": int(result.state.step), "in_flight": probe.counts if probe else None, "reads": probe.reads if probe else None}
    if a.multihost is not None and not (a.slow or a.pattern):  # restore what was just saved and compare
        from tfm.train import Checkpointer
        ckpt = Checkpointer(os.path.join(a.workdir, "checkpoints"))
        restored, data_state = ckpt.restore(result.trainer.abstract_state)
        ckpt.close()
        same = all(np.array_equal(params[k], v) for k, v in flat_params(restored).items())
        out.update(restored_equal=bool(same), data_state=data_state)
    if jax.process_index() == 0 or a.multihost is not None:
        tag = "" if a.multihost is None else f".{pid}"
        np.savez(os.path.join(a.workdir, f"params{tag}.npz"), **params)
        with open(os.path.join(a.workdir, f"result{tag}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
