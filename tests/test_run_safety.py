"""Runs cannot hurt each other or themselves: one run per workdir, a failed background save
stops the run with its last good checkpoint, and the command line's exit statuses and logs
stay truthful across preemptions and resumes."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import train_job
from tfm.train import CheckpointError, Checkpointer
from tfm.train.workdir_lock import WorkdirLock, WorkdirLockedError

JOB = os.path.join(os.path.dirname(__file__), "train_job.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(workdir, *args):
    return subprocess.Popen([sys.executable, JOB, "--workdir", str(workdir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, text, log):
    for line in proc.stdout:
        log.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} never appeared:\n" + "".join(log)[-3000:])


def _train_records(workdir):
    lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r["step"] for r in lines if r["split"] == "train"], [r["step"] for r in lines if r["split"] == "eval"]


def test_a_second_run_on_the_same_workdir_is_refused_naming_the_owner(tmp_path):
    first, log = _job(tmp_path, "--steps", "8", "--sleep", "0.4"), []
    _wait_for(first, "step 2 train", log)
    second = subprocess.run([sys.executable, JOB, "--workdir", str(tmp_path), "--steps", "8"],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    assert f"is in use by pid {first.pid} on host {socket.gethostname()}" in second.stdout + second.stderr
    log += first.stdout.readlines()
    assert first.wait(timeout=300) == 0, "".join(log)[-3000:]
    assert _train_records(tmp_path)[0] == list(range(1, 9))  # one writer: no interleaving
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [6, 8]
    assert not (tmp_path / "LOCK").exists()


def _write_lock(workdir, host, pid, age=0.0):
    path = workdir / "LOCK"
    path.write_text(json.dumps({"host": host, "pid": pid, "started": time.time()}))
    os.utime(path, (time.time() - age, time.time() - age))


def test_stale_locks_are_taken_over_and_live_ones_refused(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_lock(tmp_path, socket.gethostname(), dead.pid)
    with WorkdirLock(str(tmp_path)):
        assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    assert f"took over the stale workdir lock of pid {dead.pid}" in capsys.readouterr().out
    assert not (tmp_path / "LOCK").exists() and len(list(tmp_path.glob("LOCK.stale-*"))) == 1

    _write_lock(tmp_path, socket.gethostname(), os.getppid())  # alive, this host
    with pytest.raises(WorkdirLockedError, match=f"in use by pid {os.getppid()}"):
        WorkdirLock(str(tmp_path)).__enter__()
    _write_lock(tmp_path, "another-host", 1, age=10)  # another host, heartbeat fresh
    with pytest.raises(WorkdirLockedError, match="pid 1 on host another-host"):
        WorkdirLock(str(tmp_path), stale_after=60).__enter__()
    _write_lock(tmp_path, "another-host", 1, age=120)  # silent for longer than stale_after
    with WorkdirLock(str(tmp_path), stale_after=60):
        pass


def test_a_failed_background_save_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    """Files are capped at 16 kB after step 5: the async save of step 6 fails. It is reported at
    the first step after the background write has failed, at the latest before the next save."""
    proc = subprocess.run([sys.executable, JOB, "--workdir", str(tmp_path), "--steps", "10",
                           "--fsize_limit_at", "5"], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "saving the checkpoint of step 6 failed" in out and "Last good checkpoint: 4" in out, out[-3000:]
    assert "step 9 train" not in out and not (tmp_path / "checkpoints" / "8").exists()
    from tfm.models import DecoderLM
    from tfm.models.presets import tiny
    from tfm.train import LMTask, Trainer
    trainer = Trainer(DecoderLM(tiny("decoder")), LMTask(), train_job.config(10)).setup(next(train_job.TokenBatches()))
    ckpt = Checkpointer(tmp_path / "checkpoints")
    state, data = ckpt.restore(trainer.abstract_state)
    ckpt.close()
    assert int(state.step) == 4 and data == {"index": 4}


def _cli(workdir, *overrides, background=False):
    cmd = [sys.executable, "-m", "experiments.lm.train", "--config=experiments/lm/configs/tiny.py",
           f"--workdir={workdir}", "--config.num_train_steps=24", "--config.log_every=1",
           "--config.eval_every=8", "--config.checkpoint_every=4", "--config.progress_bar=False", *overrides]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _error_lines(stderr: str) -> list[str]:
    """stderr lines that are not absl logs: nothing else may be printed beside the error."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(("W", "I"))]


def _truncate(checkpoint, arrays_only: bool) -> None:
    """Cuts the largest file of a checkpoint's train state (array data; the metadata still reads)
    to 100 bytes, or empties every file of it."""
    files = [f for f in (checkpoint / "state").rglob("*") if f.is_file() and not f.name.startswith("_")]
    for f in [max(files, key=lambda f: f.stat().st_size)] if arrays_only else files:
        f.write_bytes(f.read_bytes()[:100] if arrays_only else b"")


def _one_error_line(proc) -> str:
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_cli_exit_statuses_logs_across_resumes_and_one_line_errors(tmp_path):
    short = _cli(tmp_path, "--config.num_train_steps=8")  # a first, shorter run of the same workdir
    assert short.returncode == 0, short.stderr[-3000:]
    proc, log = _cli(tmp_path, background=True), []
    _wait_for(proc, "step 10 train", log)
    proc.send_signal(signal.SIGTERM)
    log += proc.stdout.readlines()
    log = "".join(log)
    assert proc.wait(timeout=300) == 75, log[-3000:]  # EXIT_PREEMPTED
    assert "checkpoint saved, exiting" in log and "preempted" in log
    assert "final eval loss" not in log and "sample (" not in log  # nothing pretends it finished
    assert f"config changed since {tmp_path}/config.json (new one in {tmp_path}/config.step8.json)" in log
    assert "num_train_steps: 8 -> 24" in log

    done = _cli(tmp_path)  # resume 1: to the end, unchanged since the latest record (config.step8.json)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "config changed" not in done.stdout, done.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.glob("config*.json")) == ["config.json", "config.step8.json"]
    final = [line for line in done.stdout.splitlines() if "final eval loss" in line]
    assert len(final) == 1 and "nan" not in final[0], done.stdout[-2000:]
    again = _cli(tmp_path)  # resume 2: already finished, reports the same final metrics
    assert again.returncode == 0 and final[0] in again.stdout, again.stdout[-2000:]
    train_steps, eval_steps = _train_records(tmp_path)
    assert train_steps == list(range(1, 25)) and eval_steps == [8, 16, 24]

    checkpoints = tmp_path / "checkpoints"
    for arrays_only in (True, False):  # metadata or array reads fail, by where the cut falls
        _truncate(checkpoints / "24", arrays_only)
        line = _one_error_line(_cli(tmp_path, "--config.fallback_to_older=False"))
        assert re.match(rf"error: checkpoint {checkpoints}/24 (could not be restored|is unreadable) \(corrupt or "
                        r"partial\): \w+: ", line), line
        # the array that failed: whichever of the train state's arrays orbax's concurrent reads reach first
        assert re.search(r'Error reading "(step|rng|params|opt_state)[\w.]*/', line), line
        assert "fallback_to_older=True" in line and not re.search(r"TensorStore\(|tensorstore_spec|<bound", line), line


def test_a_workdir_whose_checkpoints_were_all_set_aside_is_not_restarted(tmp_path):
    """Every checkpoint corrupt: each is moved to checkpoints.broken/, and neither that run nor the
    next starts over from step 0 (which would overwrite the history in metrics.jsonl)."""
    assert _cli(tmp_path, "--config.num_train_steps=8").returncode == 0
    history = (tmp_path / "metrics.jsonl").read_bytes()
    for step in ("4", "8"):
        _truncate(tmp_path / "checkpoints" / step, arrays_only=True)
    refusal = (f"error: no readable checkpoint left in {tmp_path}/checkpoints: the broken ones are in "
               f"{tmp_path}/checkpoints.broken/ (never deleted). To start over from step 0 deliberately "
               f"(overwriting metrics.jsonl), move {tmp_path}/checkpoints.broken out of the workdir, or use a new --workdir")
    for _ in range(2):
        assert _one_error_line(_cli(tmp_path, "--config.num_train_steps=8")) == refusal
        assert (tmp_path / "metrics.jsonl").read_bytes() == history
    assert len(os.listdir(tmp_path / "checkpoints.broken")) == 2


def test_a_url_workdir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """gs:// would put the lock, config.json, metrics and vocabulary in a local directory named
    "gs:" on each host (filesystem calls) while only checkpoints reached the bucket."""
    from tfm.train.workdir_lock import WorkdirLock
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"workdir 'gs://bucket/run' is a URL.*gcsfuse mount"):
        WorkdirLock("gs://bucket/run")
    proc = _cli("gs://bucket/run")
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: workdir 'gs://bucket/run' is a URL"), \
        proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(ROOT, "gs:")) and not (tmp_path / "gs:").exists()
