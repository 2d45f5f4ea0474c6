"""What a newcomer meets first (issue 46): a setting that cannot apply to the model is refused in one
line naming why, before any data is generated; `make demo` leaves no directory behind."""
import os

import pytest

from experiments import demo
from experiments.lm import train as lm_train
from experiments.lm.configs import tiny as lm_tiny
from experiments.translation import train as translation_train
from experiments.translation.configs import base as translation_base
from tfm.models import presets


@pytest.mark.parametrize("preset, overrides, why", [
    ("gpt2_small", dict(rope=dict(theta=500.0)), r"rope.theta=500.0 cannot apply: position='learned' has no RoPE"),
    ("tiny_llama", dict(experts_per_token=1), r"experts_per_token=1 cannot apply: the model has no experts"),
    ("tiny_decoder", dict(router_score="sigmoid"), r"router_score='sigmoid' cannot apply: the model has no experts"),
    ("tiny_llama", dict(execution=dict(moe_impl="einsum")), r"execution.moe_impl='einsum' cannot apply: .* no experts"),
    ("tiny_llama", dict(capacity_factor=1.0, moe_impl="einsum"), r"execution.\w+=\S+ cannot apply: .* no experts"),
    ("tiny_llama", dict(mamba2=dict(state_size=4)), r"mamba2.state_size=4 cannot apply: no layer is 'mamba2'"),
    ("tiny_hybrid", dict(deltanet=dict(conv_kernel=2)), r"deltanet.conv_kernel=2 cannot apply: no layer is "
                                                        r"'gated_deltanet' \(mixer_pattern=\('mamba2', 'attention'\)\)"),
    ("tiny_llama", dict(rwkv=dict(attention_width=16)), r"rwkv.attention_width=16 cannot apply: no layer is 'rwkv'"),
    ("tiny_llama", dict(rglru=dict(c=4.0)), r"rglru.c=4.0 cannot apply"),
    ("tiny_llama", dict(mamba=dict(expand=1)), r"mamba.expand=1 cannot apply"),
    ("tiny_llama", dict(mixer_chunk_size=8), r"execution.mixer_chunk_size=8 cannot apply: no layer has a linear"),
    ("tiny_llama", dict(alibi_bias_max=4.0), r"alibi_bias_max=4.0 cannot apply: position='rope'"),
    ("tiny_encoder", dict(relative_buckets=8), r"relative_buckets=8 cannot apply: position='learned'"),
])
def test_an_override_that_cannot_apply_is_refused_naming_why(preset, overrides, why):
    with pytest.raises(ValueError, match=r"^ModelConfig\." + why) as e:
        presets.build(preset, 100, overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny_llama", dict(rope=dict(theta=500.0))), ("tiny_moe", dict(experts_per_token=1, moe_impl="einsum")),
    ("tiny_hybrid", dict(mamba2=dict(state_size=4), mixer_chunk_size=8)),
    ("tiny_llama", dict(mixer_pattern=("rwkv",), ffn_pattern=("rwkv",), rwkv=dict(attention_width=16))),
    ("gpt2_small", dict(position="rope", rope=dict(theta=500.0))),  # switched on in the same overrides
    ("tiny_decoder", dict(rope=dict(theta=10_000.0), moe_chunks=1)),  # the defaults: nothing to ignore
    ("jamba_1_5_mini", {}),  # a preset's own values (rope's, mamba2's defaults) are not overrides
])
def test_an_override_that_applies_is_taken(preset, overrides):
    presets.build(preset, 100, overrides)


@pytest.mark.parametrize("overrides, why", [(dict(position="Rope"), r"ModelConfig.position='Rope' is not one of"),
                                            (dict(rope=dict(theta=5e5)), r"rope.theta=500000.0 cannot apply")])
def test_a_bad_model_value_is_refused_before_any_data_is_generated(tmp_path, overrides, why):
    """The LM and translation experiments check the model's values before they generate a corpus or
    train a vocabulary (the workdir stays empty)."""
    lm = lm_tiny.get_config()
    translation = translation_base.get_config("runlocal")
    for train, config, workdir in ((lm_train, lm, tmp_path / "lm"), (translation_train, translation, tmp_path / "mt")):
        config.model.overrides.update(overrides)
        os.makedirs(workdir)
        with pytest.raises(ValueError, match=why):
            train.train_and_evaluate(config, str(workdir))
        assert not os.listdir(workdir)


def test_the_demo_without_a_workdir_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """Without --workdir the demo trains in a temporary directory and removes it; with one, the run
    stays there and the demo says how to score it again."""
    workdirs = []

    def fake_training(config, workdir):
        workdirs.append(workdir)
        open(os.path.join(workdir, "metrics.jsonl"), "w").close()
        return {"samples": [("en", "de", "de")], "final_loss": 0.5, "decode_seconds": 1.0}

    monkeypatch.setattr(demo.train, "train_and_evaluate", fake_training)
    monkeypatch.setattr(demo.train, "report_line", lambda scores: "BLEU")
    demo.demo(None, None)
    assert os.path.basename(workdirs[0]).startswith("tfm_demo_") and not os.path.exists(workdirs[0])
    assert f"{workdirs[0]} is removed; to keep a run" in capsys.readouterr().out
    demo.demo(None, str(tmp_path / "kept"))
    assert os.listdir(tmp_path / "kept") == ["metrics.jsonl"]
    assert f"python -m experiments.translation.evaluate --workdir={tmp_path / 'kept'}" in capsys.readouterr().out
