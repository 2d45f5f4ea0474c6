"""Preemption and crashes: SIGKILL / SIGTERM mid-run then restart ends bitwise equal to an
uninterrupted run; a NaN stops the run naming the step and deletes no checkpoint."""
import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import train_job

STEPS = 10
JOB = os.path.join(os.path.dirname(__file__), "train_job.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Params of an uninterrupted in-process run (same mesh, data order, program)."""
    result = train_job.run(str(tmp_path_factory.mktemp("ref")), STEPS)
    return train_job.flat_params(result.state)


def _launch(workdir, sleep):
    cmd = [sys.executable, JOB, "--workdir", str(workdir), "--steps", str(STEPS), "--sleep", str(sleep)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_until(proc, step, sig, workdir):
    """Read the job's log and send `sig` at the first training step >= `step` by which a finished
    checkpoint (saved in the background every 2 steps, the 2 newest kept) is on disk; returns the
    log. Checking without waiting keeps the reader in step with the job, which goes on training."""
    def saved():
        return (workdir / "checkpoints").is_dir() and any(
            d.name.isdigit() for d in (workdir / "checkpoints").iterdir())  # not orbax's *.tmp dirs

    log = []
    for line in proc.stdout:
        log.append(line)
        reached = re.match(r"step (\d+) train", line)
        if reached and int(reached.group(1)) >= step and saved():
            proc.send_signal(sig)
            break
    log += proc.stdout.readlines()
    proc.wait(timeout=120)
    return "".join(log)


def _finish_and_compare(workdir, reference):
    done = subprocess.run([sys.executable, JOB, "--workdir", str(workdir), "--steps", str(STEPS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "restored checkpoint at step" in done.stdout + done.stderr
    got = np.load(os.path.join(workdir, "params.npz"))
    assert set(got) == set(reference)
    for k, v in reference.items():
        assert np.array_equal(got[k], v), f"{k} differs after resume"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_interrupted_run_resumes_bitwise(tmp_path, reference, sig):
    kill_at = random.Random().randint(3, STEPS - 3)  # after the first checkpoint (step 2)
    log = _run_until(_launch(tmp_path, sleep=0.5), kill_at, sig, tmp_path)
    if sig == signal.SIGTERM:
        assert "SIGTERM at step" in log and "checkpoint saved" in log, log[-2000:]
    else:
        assert not os.path.exists(tmp_path / "params.npz"), "the run finished before the kill"
    _finish_and_compare(tmp_path, reference)


def test_nan_stops_naming_step_and_keeps_checkpoints(tmp_path):
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step 5.*"
                                                 r"Last good checkpoint: 4"):
        train_job.run(str(tmp_path), 8, data=train_job.TokenBatches(nan_at=5),
                      async_checkpoint=False)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def test_nan_skip_option_drops_the_update(tmp_path):
    result = train_job.run(str(tmp_path), 6, data=train_job.TokenBatches(nan_at=5),
                           on_nonfinite="skip", checkpoint_every=0)
    finite = [h["finite"] for h in result.history]
    assert finite == [1, 1, 1, 1, 0, 1]
    assert all(np.isfinite(v).all() for v in train_job.flat_params(result.state).values())
