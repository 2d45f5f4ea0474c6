"""Preemption and crashes: SIGKILL / SIGTERM mid-run then restart ends bitwise equal to an
uninterrupted run (the BERT pretraining command too: the same streamed batches); a NaN stops
the run naming the step and deletes no checkpoint."""
import json
import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import xla_env

import train_job
from tfm.data import synthetic

STEPS = 10
JOB = os.path.join(os.path.dirname(__file__), "train_job.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Params of an uninterrupted in-process run (same mesh, data order, program)."""
    result = train_job.run(str(tmp_path_factory.mktemp("ref")), STEPS)
    return train_job.flat_params(result.state)


def _launch(workdir, sleep):
    cmd = [sys.executable, JOB, "--workdir", str(workdir), "--steps", str(STEPS), "--sleep", str(sleep)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_until(proc, step, sig, workdir, past_checkpoint=False):
    """Read the job's log and send `sig` at the first training step >= `step` by which a finished
    checkpoint (saved in the background) is on disk, and with `past_checkpoint` one past the
    newest; returns the log. Checking without waiting keeps the reader in step with the job,
    which goes on training."""
    def saved():  # the newest finished checkpoint's step, 0 if none (not orbax's *.tmp dirs)
        root = workdir / "checkpoints"
        return max((int(d.name) for d in root.iterdir() if d.name.isdigit()), default=0) if root.is_dir() else 0

    log = []
    for line in proc.stdout:
        log.append(line)
        reached = re.match(r"step (\d+) train", line)
        newest = saved() if reached and int(reached.group(1)) >= step else 0
        if newest and (not past_checkpoint or newest < int(reached.group(1))):
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


BERT_STEPS = 14
BERT_FLAGS = [  # base.py:runlocal on a plain-text corpus, tiny: the recipe's stream, many windows
    "--config=experiments/bert/configs/base.py:runlocal", "--config.dataset=", "--config.chunk_bytes=5000",
    "--config.shuffle_chunks=2", "--config.eval_documents=8", "--config.eval_batches=1",
    "--config.vocab_documents=50", "--config.vocab_size=120", "--config.model.overrides.d_model=32",
    "--config.model.overrides.num_heads=2", "--config.model.overrides.num_layers=1",
    "--config.model.overrides.d_ff=64", "--config.model.overrides.max_len=64", "--config.max_seq_length=32",
    "--config.max_predictions_per_seq=5", "--config.phase2_start_step=0", "--config.batch_size=8",
    f"--config.num_train_steps={BERT_STEPS}", "--config.optimizer.warmup_steps=2", "--config.log_every=1",
    "--config.eval_every=0", "--config.checkpoint_every=3", "--config.keep_checkpoints=10",
    "--config.progress_bar=False"]
TIMINGS = {"step_time", "tokens_per_s", "mfu"}


def _pretrain(workdir, corpus, *flags, **kw):
    """`experiments.bert.pretrain` on one CPU device, as a user runs it; the runs share JAX's
    compilation cache (beside the corpus), so only the first compiles."""
    env = xla_env.subprocess_env()
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(corpus), "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen([sys.executable, "-m", "experiments.bert.pretrain", f"--workdir={workdir}",
                             *BERT_FLAGS, f"--config.text_dirs={corpus}", *flags], cwd=ROOT, env=env,
                            text=True, **kw)


def _records(workdir):
    """{(split, step): metrics without the timings} of workdir/metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {(r.pop("split"), r.pop("step")): {k: v for k, v in r.items() if k not in TIMINGS}
                for r in map(json.loads, f)}


def test_bert_pretraining_killed_mid_stream_resumes_with_the_same_batches(tmp_path):
    """kill -9 of the BERT pretraining command after a checkpoint, then the same command: every
    step's MLM/NSP losses and accuracies (the killed run's, those it redid too) and the final
    held-out metrics equal an uninterrupted run's bit for bit (fp32, one CPU device), which
    reads the vocabulary the killed run trained (WordPiece training is not deterministic). The
    data state restored is the stream position (epoch, window, index) inside a shuffle window."""
    corpus = synthetic.write_text_corpus(tmp_path / "text", 200_000, file_bytes=20_000, seed=3)
    killed = _pretrain(tmp_path / "run", corpus, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = _run_until(killed, 1, signal.SIGKILL, tmp_path / "run", past_checkpoint=True)
    assert killed.returncode == -signal.SIGKILL, log[-3000:]
    before = _records(tmp_path / "run")
    assert ("train", BERT_STEPS) not in before, "the run finished before the kill"
    reference = _pretrain(tmp_path / "ref", corpus, f"--config.vocab_path={tmp_path / 'run'}",
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resumed = _pretrain(tmp_path / "run", corpus, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and reference.wait(timeout=300) == 0, out[-3000:]
    start = int(re.search(r"restored checkpoint at step (\d+)", out).group(1))
    assert 1 <= start < BERT_STEPS
    expected, after = _records(tmp_path / "ref"), _records(tmp_path / "run")
    assert sorted(after) == sorted(expected) and len(expected) == BERT_STEPS + 1  # + the final eval
    assert {"mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"} <= set(expected["train", 1])
    for key, metrics in after.items():
        assert metrics == expected[key], key
    for key, metrics in before.items():
        assert metrics == expected[key], key
    with open(tmp_path / "run" / "checkpoints" / str(start) / "data" / "process_0-of-1.json") as f:
        position = json.load(f)["inner"]
    assert position["index"] > 0, position


def test_bert_corpus_bytes_that_are_not_utf8_are_dropped_or_the_file_refused(tmp_path):
    """A text corpus with a few undecodable bytes trains, those bytes dropped as Google's BERT
    does, with one warning per file naming it and the count, and every step's metrics (and the
    final held-out ones) equal, rtol 0, those of the same command on the corpus with the bytes
    removed beforehand (and the first run's vocabulary); a file that is not text stops the
    command before anything is written, its last line naming the file and what to do. The bytes
    sit in each file's last document and the corpus is one chunk: documents' keys and chunks'
    bounds are byte offsets of the files as they are, so bytes removed earlier move them. Byte-level
    BPE (RoBERTa's) sees every character: under WordPiece, whose normalizer drops U+FFFD, bytes
    decoded as replacement characters would pass too. One letter in place of the bytes in the
    cleaned corpus, or "replace" for "ignore" in the decoding, changes step 1's losses."""
    line = b"A line with \xff\xfe bytes \xe2\x82 that are not UTF-8.\n"  # in each file's last document
    dirty = synthetic.write_text_corpus(tmp_path / "dirty", 60_000, file_bytes=20_000, seed=3)
    clean = synthetic.write_text_corpus(tmp_path / "clean", 60_000, file_bytes=20_000, seed=3)
    names = sorted(os.listdir(dirty))
    for name in names:
        with open(os.path.join(dirty, name), "ab") as f:
            f.write(line)
        with open(os.path.join(clean, name), "ab") as f:
            f.write(line.replace(b"\xff\xfe", b"").replace(b"\xe2\x82", b""))
    flags = ("--config.num_train_steps=2", "--config.chunk_bytes=100000", "--config.tokenizer=byte_bpe",
             "--config.vocab_size=300")
    run = _pretrain(tmp_path / "run", dirty, *flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = run.communicate(timeout=300)[0]
    assert run.returncode == 0, out[-3000:]
    for path in (os.path.join(dirty, name) for name in names):
        assert out.count(f"warning: {path}: 4 undecodable bytes dropped") == 1, out[-3000:]
    with open(os.path.join(dirty, "scan.pdf"), "wb") as f:
        f.write(bytes(range(256)) * 40)
    ref = _pretrain(tmp_path / "ref", clean, *flags, f"--config.vocab_path={tmp_path / 'run'}",
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    refused = _pretrain(tmp_path / "refused", dirty, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, ref_out = refused.communicate(timeout=300)[0], ref.communicate(timeout=300)[0]
    assert ref.returncode == 0 and "undecodable" not in ref_out, ref_out[-3000:]
    expected, got = _records(tmp_path / "ref"), _records(tmp_path / "run")
    assert sorted(got) == sorted(expected) == [("eval", 2), ("train", 1), ("train", 2)]
    assert {"mlm_loss", "nsp_loss"} <= set(expected["train", 1])
    for key, metrics in got.items():
        assert metrics == expected[key], key  # rtol 0: the same floats
    last = out.strip().splitlines()[-1]
    assert refused.returncode != 0 and last.startswith("error: ") and "scan.pdf" in last, out[-3000:]
    assert "not a text file; remove it from the corpus directory" in last
    assert not os.path.exists(tmp_path / "refused" / "checkpoints")
