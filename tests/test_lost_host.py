"""A lost host, as on a pod: two processes of the LM training command joined by TFM_COORDINATOR on
this CPU, kill -9 of one after a checkpoint. The survivor ends within the heartbeat timeout (and a
half) with status 75 and, as its last line, which process was lost and what to run; running the same
command on both again resumes and ends with the losses of an undisturbed two-process run. A hang
fails the test (every wait is bounded)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 5  # TFM_HEARTBEAT_TIMEOUT, seconds
FLAGS = ["--config=experiments/lm/configs/tiny.py", "--config.num_train_steps=20", "--config.checkpoint_every=5",
         "--config.eval_every=0", "--config.log_every=5", "--config.progress_bar=False", "--config.sample_tokens=0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(workdir, data, cache) -> list:
    """The two processes of one run of the command, started."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = xla_env.subprocess_env()
        env.update(TFM_COORDINATOR=f"127.0.0.1:{port}", TFM_NUM_PROCESSES="2", TFM_PROCESS_ID=str(rank),
                   TFM_HEARTBEAT_TIMEOUT=str(TIMEOUT), JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        procs.append(subprocess.Popen([sys.executable, "-m", "experiments.lm.train", f"--workdir={workdir}", *FLAGS,
                                       f"--config.data_dir={data}"], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _finish(procs, timeout=300) -> list:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outs)  # a str: shown whole
    return outs


def _losses(workdir) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r.get("split") == "train"}


def test_a_lost_process_ends_the_survivor_in_one_line_and_the_same_command_resumes(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    _finish(_job(tmp_path / "undisturbed", data, cache))
    workdir = tmp_path / "run"
    survivor, lost = _job(workdir, data, cache)
    deadline = time.monotonic() + 300
    while not (workdir / "checkpoints" / "5").exists():
        assert time.monotonic() < deadline and survivor.poll() is None, "no checkpoint of step 5"
        time.sleep(0.5)
    lost.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out = survivor.communicate(timeout=3 * TIMEOUT + 60)[0]
    waited = time.monotonic() - killed
    lost.wait(timeout=10)
    lines = out.strip().splitlines()
    assert survivor.returncode == 75, lines[-20:]
    assert waited < 1.5 * TIMEOUT + 20, waited
    assert lines[-1] == (f"error: lost process 1 of 2: no heartbeat for {TIMEOUT} s (TFM_HEARTBEAT_TIMEOUT). Run the "
                         "same command again on every host: it resumes from the last good checkpoint"), lines[-20:]
    assert not any(line.startswith("Traceback") for line in lines), "\n".join(lines[-40:])
    outs = _finish(_job(workdir, data, cache))
    assert "restored checkpoint at step" in outs[0]
    assert _losses(workdir) == _losses(tmp_path / "undisturbed")
