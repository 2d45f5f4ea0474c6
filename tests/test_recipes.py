"""Every recipe under experiments/*/configs loads and names its experiment: the module, in the
recipe's own experiment folder, that trains it. The preflight finds a recipe's experiment by that
name and takes only those that build a blueprint."""
import importlib
import importlib.util
import pathlib

import pytest

from experiments import preflight

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = sorted(p for p in ROOT.glob("experiments/*/configs/*.py") if p.name != "__init__.py")
TRAINING = {"experiments.lm.train", "experiments.translation.train", "experiments.bert.pretrain"}  # have blueprint()


def _load(path: pathlib.Path):
    """`get_config()` of a recipe file, loaded by path as ml_collections' config flag loads it."""
    spec = importlib.util.spec_from_file_location(f"recipe_{path.parent.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_there_are_recipes():
    assert len(RECIPES) >= 15 and {p.parent.parent.name for p in RECIPES} >= {"lm", "bert", "translation"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_recipe_loads_and_names_its_experiment(path):
    config = _load(path)
    name = config.experiment
    assert name.startswith(f"experiments.{path.parent.parent.name}."), name
    module = importlib.import_module(name)
    assert callable(module.train_and_evaluate)
    if name in TRAINING:
        assert preflight.experiment_of(config, str(path)) is module
    else:
        with pytest.raises(ValueError, match=f"preflight takes the training recipes .* experiment is '{name}'"):
            preflight.experiment_of(config, str(path))


def test_an_unnamed_or_unknown_experiment_is_refused():
    config = _load(ROOT / "experiments/lm/configs/tiny.py")
    for name in (None, "experiments.nowhere.train"):
        config.experiment = name
        with pytest.raises(ValueError, match=f"experiment is {name!r}"):
            preflight.experiment_of(config, "recipe.py")
