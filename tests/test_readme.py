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
