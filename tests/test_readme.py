"""The README's "Outputs and resuming" section, run: its command works as written (on a
temporary workdir) and leaves exactly the files its table lists."""
import os
import re
import shlex
import subprocess
import sys

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
    env = {**os.environ, "TFDS_DATA_DIR": str(tmp_path / "no_tfds"), "HF_HUB_OFFLINE": "1"}
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
