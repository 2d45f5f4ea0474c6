"""Bad input on the command line is one line, `error: ...` on stderr, exit status 1, for every
entry point a newcomer runs (the train CLIs, the demo, evaluate), before any training starts."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["-m", "experiments.lm.train", "--config=experiments/lm/configs/tiny.py"]
DEMO = ["-m", "experiments.demo"]
EVALUATE = ["-m", "experiments.translation.evaluate"]
READ_ONLY = "/sys/kernel"  # an existing directory nobody, root included, can create files in


def _error(*args) -> str:
    """The one line a command prints on stderr, checked to be all it prints there, with exit status 1."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr[-3000:]
    return done.stderr.strip()


@pytest.mark.parametrize("command", [TRAIN, DEMO], ids=["train", "demo"])
def test_a_misspelt_config_key_names_the_valid_keys(command, tmp_path):
    line = _error(*command, f"--workdir={tmp_path}", "--config.num_trian_steps=5")
    assert line.startswith("error: --config.num_trian_steps is not a config key (did you mean 'num_train_steps'?); "
                           "valid keys: ['"), line
    assert "'num_train_steps'" in line and "'optimizer'" in line
    assert not os.listdir(tmp_path)  # refused before anything was written


def test_a_misspelt_nested_key_names_the_keys_of_its_level(tmp_path):
    line = _error(*TRAIN, f"--workdir={tmp_path}", "--config.optimizer.lerning_rate=1e-3")
    assert line.startswith("error: --config.optimizer.lerning_rate is not a config key (did you mean "
                           "'learning_rate'?); valid keys: ['b1', 'b2',"), line


def test_a_misspelt_rope_override_names_ropes_fields(tmp_path):
    """RoPE's settings nest under model.overrides.rope, whether the recipe sets some or none."""
    line = _error(*TRAIN, f"--workdir={tmp_path}", "--config.model.overrides.rope.thta=1e4")
    assert line.startswith("error: --config.model.overrides.rope.thta is not a config key (did you mean "
                           "'theta'?); valid keys: ['attention_factor', 'beta_fast',"), line


def test_nested_rope_overrides_reach_the_model_config():
    """`--config.model.overrides.rope.FIELD` sets one RoPE field: over the recipe's rope (llama2 sets
    theta) or the preset's, whether the recipe names that field or not."""
    code = ("import sys; from absl import flags; from experiments import common; from tfm.models import presets\n"
            "sys.argv = argv = sys.argv[1:]\n"
            "common.define_config_flag(); common.parse_flags(argv); c = flags.FLAGS.config\n"
            "print(presets.build(c.model.preset, 64, c.model.overrides.to_dict()).rope)")
    args = ["p", "--config=experiments/lm/configs/llama2.py:runlocal", "--config.model.overrides.rope.theta=5.0",
            "--config.model.overrides.rope.scaling=linear", "--config.model.overrides.rope.factor=2.0"]
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RopeConfig(theta=5.0, scaling='linear', factor=2.0," in done.stdout, done.stdout


def test_a_missing_config_file_is_named(tmp_path):
    line = _error("-m", "experiments.lm.train", "--config=experiments/lm/configs/tiyn.py", f"--workdir={tmp_path}")
    assert line == ("error: --config file experiments/lm/configs/tiyn.py not found (run from the repository root, "
                    "or give its full path)")


def test_a_missing_or_unknown_flag_is_one_line(tmp_path):
    assert _error(*TRAIN) == "error: flag --workdir=None: Flag --workdir must have a value other than None."
    assert _error(*DEMO, f"--wrkdir={tmp_path}") == "error: Unknown command line flag 'wrkdir'. Did you mean: workdir ?"


@pytest.mark.parametrize("command", [TRAIN, DEMO], ids=["train", "demo"])
def test_a_workdir_that_is_a_file_is_refused(command, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    line = _error(*command, f"--workdir={path}")
    assert line == f"error: --workdir={path} is a file, not a directory; give a directory (created if missing)"
    assert path.read_text() == "mine"


@pytest.mark.skipif(not os.path.isdir(READ_ONLY), reason="needs Linux sysfs")
@pytest.mark.parametrize("workdir", [READ_ONLY, f"{READ_ONLY}/tfm_run"], ids=["existing", "to-create"])
@pytest.mark.parametrize("command", [TRAIN, DEMO], ids=["train", "demo"])
def test_a_read_only_workdir_is_refused(command, workdir):
    line = _error(*command, f"--workdir={workdir}")
    assert line.startswith(f"error: --workdir={workdir} cannot be created or written (")
    assert line.endswith("); give a directory you can write to"), line


def test_evaluate_of_a_directory_that_holds_no_run_is_one_line(tmp_path):
    assert _error(*EVALUATE, f"--workdir={tmp_path}") == \
        f"error: {tmp_path}/config.json not found: is {tmp_path} the --workdir of a translation run?"
    assert _error(*EVALUATE) == "error: flag --workdir=None: Flag --workdir must have a value other than None."
