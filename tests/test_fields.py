"""docs/CONFIG.md, the reference of every TrainConfig and ModelConfig field, is what
`python -m experiments.fields --markdown` generates from the dataclasses; every field in it says what it
is; every allowed value it lists is one the validation enforces; recipes' docstrings name their model in
those fields' terms, and presets take the family names a user types."""
import ast
import dataclasses
import os
import re

import pytest

from experiments import fields
from tfm.config import ExecutionConfig, ModelConfig, RopeConfig
from tfm.models import presets
from tfm.parallel.mesh import MeshConfig
from tfm.train.config import OptimizerConfig, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_md_is_the_generated_reference():
    with open(os.path.join(ROOT, "docs", "CONFIG.md")) as f:
        written = f.read()
    assert written == fields.markdown() + "\n", ("docs/CONFIG.md differs from the dataclasses: run "
                                                 "`python -m experiments.fields --markdown > docs/CONFIG.md`")


def test_every_field_is_listed_with_a_meaning():
    rows = {r.key: r for section in fields.reference().values() for r in section}
    for cls, prefix in ((TrainConfig, ""), (OptimizerConfig, "optimizer."), (MeshConfig, "mesh."),
                        (ModelConfig, "model.overrides."), (RopeConfig, "model.overrides.rope."),
                        (ExecutionConfig, "model.overrides.execution.")):
        for f in dataclasses.fields(cls):
            assert prefix + f.name in rows, prefix + f.name
    missing = [key for key, r in rows.items() if not r.meaning]
    assert not missing, f"fields without a comment saying what they are: {missing}"
    assert rows["model.overrides.position"].allowed == "'sinusoidal', 'learned', 'rope', 'alibi', 'relative', 'none'"
    assert rows["model.overrides.rope.theta"].default == "10000.0"
    assert rows["model.overrides.mixer_pattern"].allowed.startswith("each of 'attention', 'mamba', 'mamba2',")
    assert rows["optimizer.schedule"].allowed == "'constant', 'noam', 'linear', 'cosine', 'bert_linear'"
    assert rows["model.overrides.qk_norm"].meaning.startswith("config.norm over each query and key head")


def _refused(build, field: str):
    with pytest.raises(ValueError, match=re.escape(field)):
        build()


@pytest.mark.parametrize("cls", [ModelConfig, ExecutionConfig, RopeConfig, OptimizerConfig, TrainConfig, MeshConfig])
def test_every_listed_choice_is_enforced(cls):
    """A value outside a field's CHOICES (or, for ENTRY_CHOICES, an entry outside them) is refused
    naming the field, so the reference's allowed values are the validation's."""
    for name in {**cls.__dict__.get("CHOICES", {}), **cls.__dict__.get("ENTRY_CHOICES", {})}:
        bad = ("nonsense",) if name in cls.__dict__.get("ENTRY_CHOICES", {}) else "nonsense"
        if cls is ModelConfig:
            _refused(lambda: presets.tiny("llama", **{name: bad}), name)
        else:
            _refused(lambda: cls(**{name: bad}), name)


def test_the_command_line_prints_a_group(capsys):
    fields.main(["model.overrides.rope.sc"])
    out = capsys.readouterr().out
    assert out.startswith("model.overrides.rope.scaling: Optional[str] = None\n    one of None, 'linear', 'ntk',")
    with pytest.raises(SystemExit):
        fields.main(["model.overides"])
    assert capsys.readouterr().err.startswith("error: no config key starts with 'model.overides'; groups: [")


RECIPES = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "experiments"))
                 if d.endswith("configs") for f in fs if f.endswith(".py") and f != "__init__.py")
_SETTING = re.compile(r"(\w+(?:\.\w+)?)=('[^']*'|\"[^\"]*\"|[\w.+-]+)")


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_docstring_names_its_model_in_config_fields(recipe):
    """Each recipe's docstring has a `Model:` line: its preset and the ModelConfig fields that say
    what kind of model it is (at least its position scheme), each equal to the built model's
    (get_config() as written, the vocabulary from the recipe's vocab_size)."""
    import importlib.util
    with open(os.path.join(ROOT, recipe)) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    line = re.search(r"^Model: (.+(?:\n {2,}.+)*)", doc, re.M)
    assert line, f"{recipe}: no `Model:` line in its docstring"
    spec = importlib.util.spec_from_file_location("recipe", os.path.join(ROOT, recipe))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    preset = config.model.preset
    if preset is None:  # fine-tuning: the model is the pretraining checkpoint's
        assert "from the checkpoint" in line.group(1), line.group(1)
        return
    assert f"`{preset}`" in line.group(1), (recipe, preset, line.group(1))
    built = presets.build(preset, config.get("vocab_size") or 32_000, config.model.overrides.to_dict())
    stated = dict(_SETTING.findall(line.group(1).split(";")[0]))  # the default variant's
    assert "position" in stated, line.group(1)
    for key, value in stated.items():
        actual = built
        for part in key.split("."):
            actual = getattr(actual, part)
        assert repr(actual) == value.replace('"', "'") or str(actual) == value, (recipe, key, value, actual)
