"""What a long pod run meets besides lost hosts, each tried as a user meets it (tests/train_job.py
as the command; 8 CPU devices, data 2 x fsdp 4, unless said): loss spikes from a poisoned stretch
of the stream are rolled back and skipped; a replica whose parameters drift from the others' stops
the run before the next checkpoint; a step that hangs while its heartbeat beats ends every process.
Every run trains the tiny decoder on train_job.PatternBatches (a permutation chain it learns in
~15 steps) and evaluates on held-out batches of it."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import train_job
import xla_env

JOB = os.path.join(os.path.dirname(__file__), "train_job.py")
STEPS = 20
COMMON = ["--pattern", "--set", "checkpoint_every=4", "--set", "learning_rate=0.03"]
SPIKES = ["--set", "spike_factor=3", "--set", "spike_window=6"]
WATCH = ["--set", "watchdog_timeout=3", "--set", "watchdog_step_factor=5", "--set", "watchdog_slow_timeout=60"]


@pytest.fixture(scope="module")
def clean():
    """An in-process run of the same program on the stream without poison: its history and final
    held-out loss (the command's runs share its compiled steps through JAX's cache)."""
    import tempfile
    result = train_job.run(tempfile.mkdtemp(), STEPS, data=train_job.PatternBatches(), eval_data=train_job.held_out(),
                           checkpoint_every=0, learning_rate=0.03)  # saves change no loss
    return [h["loss"] for h in result.history], result.eval_history[-1]["loss"]


def _job(workdir, *args):
    return subprocess.run([sys.executable, JOB, "--workdir", str(workdir), "--steps", str(STEPS), *COMMON, *args],
                          env=xla_env.subprocess_env(devices=8), capture_output=True, text=True, timeout=300)


def _last_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith(("W", "I"))]
    assert lines and lines[-1].startswith("error: "), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not any(line.startswith("Traceback") for line in lines), proc.stderr[-3000:]
    return lines[-1]


def _records(workdir, split):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _finished_checkpoints(workdir):
    return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


def _data_index(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "data", "process_0-of-1.json")) as f:
        return json.load(f)["index"]


def test_a_loss_spike_is_rolled_back_and_its_batches_skipped(tmp_path, clean):
    """Stream batches 13-15 follow another permutation: the loss of step 14 (~5) is > 3 x the median of
    the 6 before (~1), so the run goes back to the checkpoint of step 12 and skips the 4 batches after
    it (the poisoned ones among them), then finishes. Its final held-out loss is within 0.05 of the
    clean stream's run (measured: 0.5919 vs 0.5930; the poisoned stream without recovery ends at 0.788);
    the steps before the spike are the clean run's, rtol 1e-6. The checkpoints after the recovery
    hold the stream 4 batches further on than their step."""
    losses, eval_loss = clean
    proc = _job(tmp_path, *SPIKES, "--poison", "13:16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("loss spike at step 14 (loss " in proc.stdout and "rolled back to the checkpoint of step 12 and "
            "skipped the 4 batches after it (recovery 1 of at most 3 within 1000 steps)" in proc.stdout), proc.stdout[-3000:]
    [recovery] = _records(tmp_path, "recovery")
    assert recovery["step"] == 12 and recovery["spike_step"] == 14 and recovery["skipped_batches"] == 4
    assert recovery["loss"] > 3 * recovery["median"]
    train = _records(tmp_path, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in train[:12]], losses[:12], rtol=1e-6)
    assert max(r["loss"] for r in train[12:]) < 1.5  # nothing of the poison trained on
    [final] = _records(tmp_path, "eval")
    assert abs(final["loss"] - eval_loss) < 0.05, (final["loss"], eval_loss)
    assert _finished_checkpoints(tmp_path) == [16, 20]
    assert _data_index(tmp_path, 16) == 20 and _data_index(tmp_path, 20) == 24


def test_spikes_past_the_allowed_recoveries_stop_in_one_line(tmp_path):
    """Batches 13-19 poisoned, one recovery allowed: the first spike (step 14) rolls back to step 12 and
    skips 4 batches, the stream there is still poisoned, and the second spike (step 13 again) stops
    the run with a one-line error (in-process: the command prints it as the test above shows). Left:
    the checkpoints of steps 8 and 12, the latter's stream position moved past the skipped batches (a
    resume skips them too), and the recovery in metrics.jsonl."""
    from tfm.train.hooks import LossSpikeError
    with pytest.raises(LossSpikeError) as stop:
        train_job.run(str(tmp_path), STEPS, data=train_job.PatternBatches(poison=range(13, 20)), checkpoint_every=4,
                      learning_rate=0.03, spike_factor=3, spike_window=6, spike_max_recoveries=1)
    line = str(stop.value)
    assert "\n" not in line and line.startswith("loss spike at step 13 (loss "), line
    assert line.endswith(f"2 spikes within 1000 steps, more than spike_max_recoveries=1 (spike_recovery_window=1000); "
                         f"stopped. Last good checkpoint: 12 in {tmp_path}/checkpoints. Skip more of the stream "
                         "(spike_skip_batches) or lower the learning rate, then run the same command"), line
    assert _finished_checkpoints(tmp_path) == [8, 12] and _data_index(tmp_path, 12) == 16
    assert [(r["step"], r["spike_step"]) for r in _records(tmp_path, "recovery")] == [(12, 14)]
    assert max(r["step"] for r in _records(tmp_path, "train")) <= 15


def test_a_replica_that_drifts_stops_the_run_before_the_next_checkpoint(tmp_path, clean):
    """8 data-parallel replicas; after step 5 the first parameter of replica 3 gets 1e-3 added
    (train_job's corrupt_replica: what a core computing wrong leaves). The check every 4 steps passed at
    step 4; the save of step 8 checks first and the run stops in one line naming replica 3 and step 8.
    No checkpoint after the corruption; the losses before it are the clean run's (another mesh:
    atol 1e-5)."""
    losses, _ = clean
    proc = _job(tmp_path, "--set", "replica_check_every=4", "--set", "mesh={'data': 8}", "--corrupt_replica", "3:5")
    line = _last_line(proc)
    assert proc.returncode == 1
    assert line == ("error: at step 8, replica 3 of 8 (device 3 on process 0) holds parameters that differ from the "
                    "other replicas': 1 of 36 parameter arrays, first decoder/final_norm/bias (replica_check_every=4, "
                    "last agreement at step 4); stopped before saving. Last good checkpoint: 4 in "
                    f"{tmp_path}/checkpoints. A device that computes wrong values: take its host out of the job, then "
                    "run the same command to resume from that checkpoint"), line
    assert _finished_checkpoints(tmp_path) == [4]
    train = _records(tmp_path, "train")
    np.testing.assert_allclose([r["loss"] for r in train[:5]], losses[:5], atol=1e-5, rtol=0)



def _two_processes(workdir, *args, steps=10):
    """The command as two processes of one CPU device each, joined through jax.distributed (data 2)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [subprocess.Popen([sys.executable, JOB, "--workdir", str(workdir), "--steps", str(steps), *COMMON, *args,
                              "--set", "mesh={'data': 2}", "--multihost", str(i), "--port", str(port)],
                             env=xla_env.subprocess_env(devices=1),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def test_a_hung_step_ends_every_process_in_one_line_and_the_same_command_resumes(tmp_path, clean):
    """Process 1 of 2 blocks inside step 6 (train_job's hang hook: its heartbeat thread goes on). Within
    the bound its line states (watchdog_timeout=3 s, or 5 x the median step where that is longer) and 5 s
    more (the watchdog's poll, every process seeing the line, exiting), both exit with status 75 and the
    same last line naming process 1, step 6 and its phase; the checkpoint of step 4 is left. The same
    command resumes from it and ends (10 steps) with the losses of the one-process 8-device run on the same
    stream (atol 1e-5, as test_multihost; a constant learning rate, so its first 10 steps are a 10-step run's)."""
    losses, _ = clean
    procs = _two_processes(tmp_path, *WATCH, "--hang", "1:6")
    logs = [[], []]
    for line in procs[1].stdout:
        logs[1].append(line)
        if line.startswith("hanging in step 6"):
            break
    hung = time.monotonic()
    logs[1] += procs[1].stdout.readlines()
    logs[0] = procs[0].communicate(timeout=120)[0].splitlines(keepends=True)
    procs[1].wait(timeout=60)
    waited = time.monotonic() - hung
    expected = (r"error: process 1 of 2 stopped making progress in step 6 \(phase: step\): nothing moved for ([\d.]+) s, "
                r"the bound (max\(watchdog_timeout=3 s, watchdog_step_factor=5 x the median step [\d.e-]+ s\)|"
                r"watchdog_slow_timeout=60 s)\. Every process of the job stopped; run the same command again on every "
                r"host: it resumes from the last good checkpoint")
    for proc, log in zip(procs, logs):
        lines = [line.rstrip() for line in log if line.strip() and not line.startswith(("W", "I"))]
        assert proc.returncode == 75, "".join(log)[-3000:]
        assert re.fullmatch(expected, lines[-1]), lines[-5:]
        assert not any(line.startswith("Traceback") for line in lines), "".join(log)[-3000:]
    bound = float(re.fullmatch(expected, lines[-1]).group(1))
    assert waited < bound + 5, (waited, bound)
    assert _finished_checkpoints(tmp_path) == [4]
    procs = _two_processes(tmp_path, *WATCH)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outs)  # a str: shown whole
    assert "restored checkpoint at step 4" in outs[0]
    train = _records(tmp_path, "train")
    assert [r["step"] for r in train] == list(range(1, 11))
    np.testing.assert_allclose([r["loss"] for r in train], losses[:10], atol=1e-5, rtol=0)



def test_the_watchdog_bounds_each_phase():
    """No step time known: the slow bound; then max(timeout, factor x the median step); compile, save,
    eval and finish always the slow bound. One process names itself."""
    from tfm.train.watchdog import Watchdog
    watchdog = Watchdog(3, 5, 60)
    assert watchdog.bound("step") == (60, "watchdog_slow_timeout=60 s")
    watchdog.steps.extend([0.2, 1.0, 0.4])
    assert watchdog.bound("data")[0] == 3  # 5 x 0.4 s < 3 s
    watchdog.steps.extend([1.0, 1.0])
    limit, why = watchdog.bound("step")
    assert (limit, why) == (5, "max(watchdog_timeout=3 s, watchdog_step_factor=5 x the median step 1 s)")
    assert [watchdog.bound(p)[0] for p in ("compile", "save", "eval", "finish")] == [60] * 4
    assert watchdog._line(7, "data", limit, why) == (
        "error: process 0 of 1 stopped making progress in step 7 (phase: data): nothing moved for 5 s, the bound "
        "max(watchdog_timeout=3 s, watchdog_step_factor=5 x the median step 1 s). Every process of the job stopped; "
        "run the same command again on every host: it resumes from the last good checkpoint")

@pytest.mark.parametrize("fields,message", [
    (dict(spike_factor=1.0), r"spike_factor must be None or > 1, got 1.0"),
    (dict(spike_factor=3, checkpoint_every=0), r"checkpoint_every must be >= 1 with spike_factor set"),
    (dict(spike_factor=3, checkpoint_every=4, spike_skip_batches=3),
     r"spike_skip_batches must be None or an integer >= checkpoint_every \(4\), so the batch that spiked"),
    (dict(spike_factor=3, spike_window=0), r"spike_window must be an integer >= 1, got 0"),
    (dict(spike_factor=3, spike_max_recoveries=0), r"spike_max_recoveries must be an integer >= 1"),
    (dict(spike_factor=3, spike_recovery_window=0.5), r"spike_recovery_window must be an integer >= 1"),
    (dict(spike_window=6), r"spike_window=6 is not read without TrainConfig.spike_factor"),
    (dict(spike_skip_batches=8), r"spike_skip_batches=8 is not read without TrainConfig.spike_factor"),
    (dict(replica_check_every=-1), r"replica_check_every must be an integer >= 0, got -1"),
    (dict(watchdog_timeout=-1), r"watchdog_timeout must be a number of seconds >= 0 \(0: no watchdog\), got -1"),
    (dict(watchdog_step_factor=0.5), r"watchdog_step_factor must be a number >= 1, got 0.5"),
    (dict(watchdog_slow_timeout=0), r"watchdog_slow_timeout must be a number of seconds > 0, got 0"),
    (dict(watchdog_timeout=0, watchdog_slow_timeout=60), r"watchdog_slow_timeout=60 is not read with "
     r"TrainConfig.watchdog_timeout=0 \(no watchdog\)"),
])
def test_every_fault_key_is_checked_naming_it(fields, message):
    from tfm.train import TrainConfig
    with pytest.raises(ValueError, match=rf"TrainConfig\.{message}"):
        TrainConfig(**fields)
