"""A full disk during a checkpoint save, through the LM training command as a user runs it: the run
stops with one line (no thread traceback) naming the cause, the space and what to do; the half-written
step is gone; metrics.jsonl stays whole; after space is freed the same command resumes and ends with
an undisturbed run's losses.

The full device is a small tmpfs mounted for the test (root, as on the project's machines); where
mounting is not allowed the test is skipped, saying so."""
import json
import os
import subprocess
import sys

import pytest

import xla_env

from tfm.train.checkpoint import directory_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--config=experiments/lm/configs/tiny.py", "--config.num_train_steps=40", "--config.checkpoint_every=10",
         "--config.keep_checkpoints=10", "--config.eval_every=0", "--config.log_every=5",
         "--config.progress_bar=False", "--config.sample_tokens=0"]


def _train(workdir, data_dir, cache, *extra):
    env = xla_env.subprocess_env()
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.run([sys.executable, "-m", "experiments.lm.train", f"--workdir={workdir}",
                           *FLAGS, f"--config.data_dir={data_dir}", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]  # every line whole
    return {r["step"]: r["loss"] for r in records if r.get("split") == "train"}


@pytest.fixture
def small_device(tmp_path):
    mount = tmp_path / "device"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): the full-disk test needs one")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_stops_in_one_line_and_the_same_command_resumes(tmp_path, small_device):
    data, cache = tmp_path / "data", tmp_path / "cache"
    reference = _train(tmp_path / "reference", data, cache)
    assert reference.returncode == 0, reference.stderr[-3000:]
    one = directory_bytes(tmp_path / "reference" / "checkpoints" / "10")
    others = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(tmp_path / "reference") for n in ns
                 if "checkpoints" not in r)
    room = others + int(2.5 * one) + (64 << 10)  # the run's other files and two checkpoints, not three
    subprocess.run(["mount", "-o", f"remount,size={room}", str(small_device)], check=True)
    workdir = small_device / "run"
    full = _train(workdir, data, cache)
    lines = (full.stdout + full.stderr).strip().splitlines()
    assert full.returncode == 1, lines[-20:]
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-40:])
    last = lines[-1]
    assert last.startswith("error: at step ") and "did not fit: no space left on the device of" in last, last
    assert "Last good checkpoint: 20" in last and "Free space there and run the same command" in last, last
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "20"]  # the half-written step removed
    stopped = _losses(workdir)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_device)], check=True)
    resumed = _train(workdir, data, cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored checkpoint at step 20" in resumed.stdout + resumed.stderr
    expected = _losses(tmp_path / "reference")
    assert _losses(workdir) == expected and all(expected[step] == loss for step, loss in stopped.items())
