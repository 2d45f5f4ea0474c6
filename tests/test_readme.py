"""The README's commands, run as written (on temporary workdirs, CPU-sized): the "Outputs and
resuming" command leaves exactly the files its table lists; the local translation commands, in
order, score what they trained; its `make` targets and environment are as it says."""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section(title):
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_outputs_section_command_and_workdir_layout(tmp_path):
    section = _section("Outputs and resuming")
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).replace("\\\n", " ")
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "experiments.lm.train"]
    args = [sys.executable] + [f"--workdir={tmp_path}" if a.startswith("--workdir=") else a for a in args[1:]]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final eval loss" in run.stdout
    noise = [c for c in ("\r", "\x1b[") if c in run.stdout + run.stderr]  # a log is not a terminal
    assert not noise, f"progress-bar codes {noise} in the log: {(run.stdout + run.stderr)[-2000:]!r}"
    listed = re.findall(r"^\| `([^`]+)`", section, re.M)
    expected = {"config.json", "metrics.jsonl", "tensorboard/", "checkpoints/<step>/", "spm_<V>.model"}
    assert expected <= set(listed)
    present = set(os.listdir(tmp_path))
    assert {"config.json", "metrics.jsonl", "tensorboard", "checkpoints", "data", "spm_256.model"} <= present
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["20", "40"]
    assert "LOCK" not in present  # released at the end
    unlisted = present - {p.split("/")[0].split("<")[0].rstrip("_") for p in listed} - {"data", "spm_256.model"}
    assert not unlisted, f"the README's table does not mention {unlisted}"


def test_each_experiment_readme_maps_every_file_and_config():
    """experiments/<name>/README.md names each of its modules and config files, and each
    `python -m experiments...` command in it names a module that exists."""
    base = os.path.join(ROOT, "experiments")
    for name in sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)) and d != "__pycache__"):
        folder = os.path.join(base, name)
        text = open(os.path.join(folder, "README.md")).read()
        files = [f for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"]
        files += [f"configs/{f}" for f in os.listdir(os.path.join(folder, "configs"))
                  if f.endswith(".py") and f != "__init__.py"]
        missing = [f for f in files if f"`{f}`" not in text and f"`{f.split('/')[-1]}`" not in text]
        assert not missing, f"experiments/{name}/README.md does not name {missing}"
        for module in re.findall(r"python -m (experiments\.[\w.]+)", text):
            assert os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"), module


def _local_paths(args, tmp_path):
    """Each `--flag=/tmp/NAME` as `--flag=<tmp_path>/NAME`."""
    return [re.sub(r"=/tmp/(\w+)$", lambda m: f"={tmp_path / m.group(1)}", a) for a in args]


def test_bert_runlocal_pretraining_then_fine_tuning_offline(tmp_path):
    """The README's CPU-sized BERT commands as written (workdirs under tmp_path; pretraining cut to
    30 steps of one phase), offline: fine-tuning starts from pretraining's last checkpoint, trains
    40 steps and scores all 500 dev pairs of the generated task (accuracy a multiple of 0.2%)."""
    commands = re.findall(r"^python -m experiments\.bert\.\w+ .*runlocal.*$", _section("Reproductions"), re.M)
    pretrain, finetune = (_local_paths(shlex.split(c), tmp_path) for c in commands)
    assert pretrain[2] == "experiments.bert.pretrain" and finetune[2] == "experiments.bert.finetune", commands
    shrink = ["--config.num_train_steps=30", "--config.phase2_start_step=0", "--config.synthetic_documents=300",
              "--config.eval_documents=40", "--config.optimizer.warmup_steps=3", "--config.eval_every=30",
              "--config.checkpoint_every=30", "--config.log_every=10", "--config.progress_bar=False"]
    env = xla_env.subprocess_env(TFDS_DATA_DIR=str(tmp_path / "no_tfds"), HF_HUB_OFFLINE="1")  # one device, as a user's CPU
    for args in (pretrain + shrink, finetune + ["--config.progress_bar=False"]):
        run = subprocess.run([sys.executable] + args[1:], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, (args, run.stderr[-3000:])
    assert f"initialised from tfm checkpoint {tmp_path / 'bert'}/checkpoints/30" in run.stdout, run.stdout[-3000:]
    report = re.search(r"^synthetic_topic_pairs lr 0.0003 \((\d+) steps\): synthetic_topic_pairs_accuracy ([\d.]+),",
                       run.stdout, re.M)
    assert report and report.group(1) == "40", run.stdout[-3000:]  # 128 examples, 5 epochs of batch 16
    accuracy = float(report.group(2))
    assert 0 <= accuracy <= 100 and abs(accuracy * 5 - round(accuracy * 5)) < 1e-6, accuracy


def _bleu_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if "bleu_moses_compound_split" in line)


def _command(args, tmp_path, shrink):
    """A README command as run here: this interpreter, the workdir under tmp_path; training CPU-sized
    (the demo runs as `make demo` does: the README states what it prints)."""
    assert args[0] == "python"
    args = [sys.executable] + [f"--workdir={tmp_path}/{a.rsplit('/', 1)[1]}" if a.startswith("--workdir=") else a
                               for a in args[1:]]
    return args + (shrink if args[2] == "experiments.translation.train" else [])


def _demo_figures() -> tuple:
    """(bleu_moses_compound_split, sacreBLEU) as the README's Reproductions table states `make demo`'s."""
    row = next(line for line in _section("Reproductions").splitlines() if "| `make demo` |" in line)
    found = re.search(r"\| ([\d.]+) `bleu_moses_compound_split`, ([\d.]+) sacreBLEU", row)
    assert found, row
    return found.groups()


def test_local_translation_commands_in_order(tmp_path):
    """The README's local translation commands, in order: the demo prints the BLEU the README states
    for `make demo` (so a change that moves it updates the README with it) and no loss term the
    model lacks; evaluate repeats the demo's BLEU and, after a run stopped by Ctrl-C and resumed, the
    resumed run's, each naming the final step; a workdir whose final checkpoint is missing (as every
    runlocal run left it before) is refused."""
    block = next(b for b in re.findall(r"```bash\n(.*?)\n```", _section("Reproductions"), re.S)
                 if "experiments.demo" in b)
    shrink = ["--config.num_train_steps=30", "--config.synthetic_pairs=500", "--config.eval_examples=8",
              "--config.log_every=1"]
    commands = [_command(args, tmp_path, shrink) for args in map(lambda l: shlex.split(l, comments=True),
                                                                 block.splitlines()) if args]
    assert [c[2] for c in commands] == ["experiments.demo", "experiments.translation.evaluate",
                                        "experiments.translation.train", "experiments.translation.train",
                                        "experiments.translation.evaluate"]
    one_device = xla_env.subprocess_env()  # as a user's CPU; the tests' compile flags
    run = lambda args, env=one_device: subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                                                      env=env)
    # the demo and its evaluation exactly as a user's machine runs them: XLA's default compile flags, every core
    user = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    with xla_env.every_core():
        demo = run(commands[0], env=user)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert _bleu_line(demo.stdout).endswith("(checkpoint step 600)"), demo.stdout[-3000:]
    printed = re.search(r"bleu_moses_compound_split ([\d.]+) .* sacreBLEU ([\d.]+) ", _bleu_line(demo.stdout)).groups()
    assert printed == _demo_figures(), (f"`make demo` prints BLEU {printed}, the README's Reproductions table says "
                                        f"{_demo_figures()}: update the README (and RESULTS' seed spread if it moved far)")
    assert not re.search(r"\b(z_loss|moe_aux_loss)=", demo.stdout), demo.stdout[-3000:]  # no such terms here
    assert f"python -m experiments.translation.evaluate --workdir={tmp_path}/demo" in demo.stdout
    with xla_env.every_core():
        scored = run(commands[1], env=user)
    assert scored.returncode == 0 and scored.stderr == "", scored.stderr[-3000:]  # no absl INFO lines
    assert _bleu_line(scored.stdout) == f"{_bleu_line(demo.stdout)}; translations in {tmp_path}/demo/translations.test.txt"

    first, log = subprocess.Popen(commands[2], cwd=ROOT, env=one_device, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True), []
    for line in first.stdout:
        log.append(line)
        if line.startswith("step 3 train"):
            first.send_signal(signal.SIGINT)
    assert first.wait(timeout=300) == 75, "".join(log)[-3000:]
    stopped = int(re.search(r"SIGINT at step (\d+)", "".join(log)).group(1))
    resumed = run(commands[3])
    assert resumed.returncode == 0 and f"restored checkpoint at step {stopped}" in resumed.stdout, resumed.stderr[-3000:]
    assert _bleu_line(resumed.stdout).endswith("(checkpoint step 30)")
    scored = run(commands[4])
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert _bleu_line(scored.stdout).startswith(_bleu_line(resumed.stdout) + "; translations in ")

    workdir = tmp_path / "wmt_local"
    shutil.rmtree(workdir / "checkpoints" / "30")
    stale = run(commands[4])
    assert stale.returncode == 1 and stale.stdout == "", stale.stdout[-3000:]
    assert stale.stderr == (f"error: the newest checkpoint in {workdir}/checkpoints is step {stopped}, but the run "
                            "logged step 30 (metrics.jsonl): its final state was not saved, so its score would not "
                            "be the run's. Run its training command again on this workdir (it resumes and saves), "
                            "then evaluate\n")


def test_readme_says_how_to_use_the_environment_make_installs():
    """`make` installs into a virtual environment; the README's bare `python` commands need it active."""
    venv = re.search(r"^VENV := (\S+)$", open(os.path.join(ROOT, "Makefile")).read(), re.M).group(1)
    text = open(os.path.join(ROOT, "README.md")).read()
    assert f"source {venv}/bin/activate" in text
    assert text.index(f"source {venv}/bin/activate") < text.index("python -m ")


def test_make_bench_leaves_the_heavy_cases_to_bench_full():
    """`make bench` fits the development machine (2 cores, 24 GB, other jobs running): the BERT-base
    and GPT-2-small train steps, which the kernel killed at 13.6 GB, run only in `make bench-full`."""
    dry = lambda target: subprocess.run(["make", "-n", target], cwd=ROOT,
                                        capture_output=True, text=True, check=True).stdout
    step = [line for line in dry("bench").splitlines() if "benchmarks.train_step" in line]
    assert len(step) == 1 and step[0].endswith("--only transformer"), step
    assert any(line.endswith("benchmarks.train_step --only bert,gpt2") for line in dry("bench-full").splitlines())
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "`make bench-full`" in text and "GB" in text.split("`make bench-full`", 1)[1].split("\n\n", 1)[0]
