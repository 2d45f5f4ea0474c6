"""experiments.common's `--config.KEY=VALUE` overrides, applied to the ConfigDict ml_collections
loaded (the recipe file is loaded once), each key checked against the config schema first."""
import os
import subprocess
import sys

import pytest
from absl import flags

from experiments import common
from experiments.lm.configs import llama2, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _locked(config):
    config.lock()
    return config


def test_overrides_take_the_configs_types_and_add_unset_model_fields():
    c = _locked(tiny.get_config())
    common.apply_overrides(c, ["--config.num_train_steps=7", "--config.optimizer.learning_rate=0.5",
                               "--config.model.overrides.d_model=48",          # set by the recipe: an int
                               "--config.model.overrides.activation=silu",      # unset: a string
                               "--config.model.overrides.head_dim=8",           # unset: a literal
                               "--config.model.overrides.rope.theta=5.0"])      # a group the recipe leaves unset
    assert (c.num_train_steps, c.optimizer.learning_rate) == (7, 0.5)
    overrides = c.model.overrides.to_dict()
    assert (overrides["d_model"], overrides["activation"], overrides["head_dim"]) == (48, "silu", 8)
    assert overrides["rope"] == {"theta": 5.0}
    assert c.is_locked and c.model.overrides.is_locked
    with pytest.raises(flags.IllegalFlagValueError, match="invalid literal for int"):
        common.apply_overrides(_locked(tiny.get_config()), ["--config.num_train_steps=x"])


def test_a_rope_override_merges_into_the_recipes_rope():
    c = _locked(llama2.get_config("runlocal"))
    theta = c.model.overrides.rope.to_dict()
    common.apply_overrides(c, ["--config.model.overrides.rope.factor=2.0"])
    assert c.model.overrides.rope.to_dict() == {**theta, "factor": 2.0}


@pytest.mark.parametrize("arg,message", [
    ("--config.num_trian_steps=5", "--config.num_trian_steps is not a config key (did you mean 'num_train_steps'?)"),
    ("--config.optimizer.lerning_rate=1", "--config.optimizer.lerning_rate is not a config key (did you mean "
                                          "'learning_rate'?); valid keys: ['b1', 'b2',"),
    ("--config.model.overrides.dmodel=8", "--config.model.overrides.dmodel is not a config key (did you mean "
                                          "'d_model'?)"),
    ("--config.model.overrides.rope.thta=1", "--config.model.overrides.rope.thta is not a config key (did you "
                                             "mean 'theta'?); valid keys: ['attention_factor',"),
    ("--config.batch_size.rows=1", "--config.batch_size.rows is not a config key; valid keys: []"),
])
def test_a_misspelt_key_is_named_with_its_levels_keys(arg, message):
    c = _locked(tiny.get_config())
    with pytest.raises(ValueError) as e:
        common.apply_overrides(c, ["--config.num_train_steps=9", arg])
    assert str(e.value).startswith(message), str(e.value)
    assert c.num_train_steps == 300 and "dmodel" not in c.model.overrides  # nothing applied


def test_the_recipe_file_is_loaded_once(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text("from experiments.lm.configs import tiny\n\n"
                      "def get_config(arg=''):\n    print('loaded', flush=True)\n    return tiny.get_config()\n")
    code = ("import sys; from absl import flags; from experiments import common\n"
            "sys.argv = argv = sys.argv[1:]\n"
            "common.define_config_flag(); common.parse_flags(argv)\n"
            "print(flags.FLAGS.config.model.overrides.d_model)")
    run = lambda *args: subprocess.run([sys.executable, "-c", code, "p", f"--config={recipe}", *args], cwd=ROOT,
                                       capture_output=True, text=True, timeout=300,
                                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    done = run("--config.model.overrides.d_model=48")
    assert done.returncode == 0 and done.stdout.split() == ["loaded", "48"], done.stdout + done.stderr[-2000:]
    done = run("--config.model.overrides.dmodel=48")
    assert done.returncode == 1 and done.stdout.split() == ["loaded"], done.stdout + done.stderr[-2000:]
    assert done.stderr.startswith("error: --config.model.overrides.dmodel is not a config key") \
        and done.stderr.count("\n") == 1, done.stderr[-2000:]
