"""The engine's seams: one experiment config schema whose every key reaches the trainer, the
loop's hooks (evaluation, best checkpoint, config record), and a host that runs ahead."""
import dataclasses
import json
import os
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

import train_job
from experiments import common
from experiments.bert.configs import base as bert_base, large as bert_large, roberta
from experiments.bert.settings import BertSettings
from experiments.lm.configs import gpt2_small, hybrid, llama, llama2, open_models, tiny
from experiments.lm.settings import LMSettings
from experiments.translation import train as translation_train
from experiments.translation.configs import base, big
from experiments.translation.settings import TranslationSettings
from tfm.models import DecoderLM
from tfm.parallel import MeshConfig
from tfm.train import (Checkpointer, CheckpointError, Hook, LMTask, MLMTask, OptimizerConfig, Seq2SeqTask,
                       TrainConfig, train_and_evaluate)

RECIPES = [(tiny, LMSettings, LMTask), (gpt2_small, LMSettings, LMTask), (llama, LMSettings, LMTask),
           (base, TranslationSettings, Seq2SeqTask), (big, TranslationSettings, Seq2SeqTask),
           (bert_base, BertSettings, MLMTask), (bert_large, BertSettings, MLMTask), (roberta, BertSettings, MLMTask),
           (llama2, LMSettings, LMTask), (hybrid, LMSettings, LMTask),
           (open_models, LMSettings, LMTask)]
TOKEN_BUDGET = {"batch_size": 64}  # what translation derives from tokens_per_batch at run time


def _keys(d, prefix=""):
    out = set()
    for k, v in d.items():
        nested = isinstance(v, dict) and k != "overrides"
        out |= _keys(v, f"{prefix}{k}.") if nested else {prefix + k}
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: ".".join(r[0].__name__.split(".")[-3::2]))
def test_runlocal_only_shrinks_and_every_recipe_resolves(recipe):
    module, settings, task = recipe
    full, local = module.get_config(), module.get_config("runlocal")
    assert _keys(full.to_dict()) == _keys(local.to_dict())
    assert set(full.model.overrides) <= set(local.model.overrides)
    assert full.model.preset == local.model.preset
    derived = TOKEN_BUDGET if settings is TranslationSettings else {}
    for c in (full, local):
        exp = common.resolve(c, settings, task, **derived)
        assert exp.model(c.vocab_size).vocab_size == c.vocab_size
    small, big = (common.resolve(c, settings, task, **derived).model(256) for c in (local, full))
    assert small.d_model <= big.d_model and small.num_layers <= big.num_layers


def test_a_derived_value_never_overrides_one_the_user_set():
    c = base.get_config()
    assert common.resolve(c, TranslationSettings, Seq2SeqTask, batch_size=112).train.batch_size == 112
    c.batch_size = 256
    with pytest.raises(ValueError, match=r"config.batch_size=256 is set, but this experiment derives it \(112\)"):
        common.resolve(c, TranslationSettings, Seq2SeqTask, batch_size=112)
    c.tokens_per_batch = 0  # the budget off: batch_size rows
    assert translation_train.batch_rows(common.settings_of(c, TranslationSettings), None, None) == {}
    assert common.resolve(c, TranslationSettings, Seq2SeqTask).train.batch_size == 256


def test_misspelt_keys_fail_naming_the_key():
    c = tiny.get_config()
    with pytest.raises(AttributeError, match="microbatchs"):
        c.microbatchs = 4
    with pytest.raises(AttributeError, match="lerning_rate"):
        c.optimizer.lerning_rate = 1.0
    raw = c.to_dict()
    raw["optimizer"]["lerning_rate"] = 1.0
    with pytest.raises(ValueError, match=r"config.optimizer.lerning_rate .*did you mean 'learning_rate'"):
        common.resolve(raw, LMSettings, LMTask)
    raw = c.to_dict()
    raw["task"]["zloss"] = 1e-4
    with pytest.raises(ValueError, match=r"config.task.zloss .*'z_loss'"):
        common.resolve(raw, LMSettings, LMTask)
    raw = c.to_dict()
    raw["model"]["overrides"]["d_modle"] = 8
    with pytest.raises(ValueError, match=r"\['d_modle'\] are not ModelConfig fields"):
        common.resolve(raw, LMSettings, LMTask).model(64)
    raw = c.to_dict()
    raw["batch_size"] = 0
    with pytest.raises(ValueError, match=r"TrainConfig.batch_size must be an integer >= 1, got 0"):
        common.resolve(raw, LMSettings, LMTask)


def _parse(argv):
    """The experiment entry point's --config flag, parsed as absl.app does."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config


def test_command_line_overrides_reach_a_translation_recipe():
    path = os.path.join(os.path.dirname(base.__file__), "base.py")
    config = _parse(["prog", f"--config={path}:runlocal", "--config.microbatches=4", "--config.task.z_loss=0.0001", "--config.optimizer.b2=0.99", "--config.mesh.fsdp=2",
                     "--config.keep_best=sacrebleu", "--config.async_checkpoint=False"])
    exp = common.resolve(config, TranslationSettings, Seq2SeqTask, **TOKEN_BUDGET)
    assert (exp.train.microbatches, exp.task.z_loss, exp.train.optimizer.b2) == (4, 1e-4, 0.99)
    assert (exp.train.mesh.fsdp, exp.train.keep_best, exp.train.async_checkpoint) == (2, "sacrebleu", False)
    with pytest.raises(Exception, match="microbatchs"):
        _parse(["prog", f"--config={path}:runlocal", "--config.microbatchs=4"])


# A valid value other than the recipe's for the fields whose type alone does not give one.
OTHER_VALUES = {"on_nonfinite": "skip", "keep_best_mode": "min", "parallelism": "fsdp+tensor", "dcn_axis": "fsdp",
                "keep_best": "bleu", "wandb_project": "tfm-test", "batch_size": 12, "microbatches": 3,
                "decay_mask": "all", "frozen": "embed/",
                "spike_factor": 3.0, "spike_skip_batches": 200}  # >= checkpoint_every (102 on that line)
# Optimizer fields are read only under some optimizers and schedules (others are refused), so
# they are set in two command lines: these fields in the second, every other field in the first.
SECOND_LINE = ("optimizer.weight_decay", "optimizer.decay_mask", "optimizer.decay_steps", "optimizer.end_lr_factor")
LINES = ({"optimizer.name": "adam", "optimizer.schedule": "noam", "optimizer.weight_decay": 0.0},
         {"optimizer.name": "lamb", "optimizer.schedule": "linear"})


def _other_value(field, hint, current):
    """A valid value of a field's type that differs from `current`."""
    if field in OTHER_VALUES:
        return OTHER_VALUES[field]
    kind = common._field_type(hint)
    if kind is bool:
        return not current
    if kind is int:
        return 2 if current in (None, -1) else current + 2
    assert kind is float, (field, hint)
    return 0.5 if not current else current / 2


def test_command_line_sets_every_train_optimizer_and_mesh_field():
    """Each TrainConfig, OptimizerConfig and MeshConfig field, set to a value other than the
    recipe's as `--config.KEY=VALUE`, arrives in the resolved TrainConfig."""
    path = os.path.join(os.path.dirname(tiny.__file__), "tiny.py")
    recipe = tiny.get_config()
    owners = {"": TrainConfig, "optimizer.": OptimizerConfig, "mesh.": MeshConfig}
    lines = [dict(line) for line in LINES]  # key -> value set on that command line
    tested = [{}, {}]
    for prefix, cls in owners.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            current = recipe[f.name] if not prefix else recipe[prefix[:-1]][f.name]
            i = int(key in SECOND_LINE)
            value = lines[i][key] if key in lines[i] else _other_value(f.name, hints[f.name], current)
            assert value != current, key
            lines[i][key], tested[i][key] = value, value
    for line, expected in zip(lines, tested):
        flags_ = [f"--config.{k}={v}" for k, v in line.items()]
        train = common.resolve(_parse(["prog", f"--config={path}", *flags_]), LMSettings, LMTask).train
        owner = lambda key: getattr(train, key.split(".")[0]) if "." in key else train
        assert {k: getattr(owner(k), k.split(".")[-1]) for k in expected} == expected
    assert len(tested[0]) + len(tested[1]) == sum(len(dataclasses.fields(c)) for c in owners.values()) - 2


def _experiment(**changes):
    """The tiny LM recipe with `changes` (dotted keys), resolved, sized for train_job's data."""
    c = tiny.get_config()
    c.batch_size, c.log_every, c.checkpoint_every, c.progress_bar = train_job.BATCH, 1, 0, False
    c.mesh.update(data=2, fsdp=4)
    c.parallelism = "data+fsdp"
    for key, value in changes.items():
        *parents, name = key.split(".")
        target = c
        for part in parents:
            target = target[part]
        target[name] = value
    return common.resolve(c, LMSettings, LMTask)


def _train(exp, workdir, steps, data=None, **kw):
    model = DecoderLM(exp.model(train_job.VOCAB))
    train = dataclasses.replace(exp.train, num_train_steps=steps)
    return train_and_evaluate(train, str(workdir), model=model, task=exp.task,
                              train_data=data or train_job.TokenBatches(), **kw)


class _Capture(Hook):
    def start(self, run):
        self.run = run


def test_config_values_reach_the_trainer(tmp_path):
    """microbatches, on_nonfinite, async_checkpoint and z_loss, set in an experiment config,
    each change what the trainer does."""
    plain = _train(_experiment(), tmp_path / "plain", 2)
    assert all("z_loss" not in h and "moe_aux_loss" not in h for h in plain.history)  # no such terms
    z = _train(_experiment(**{"task.z_loss": 1e-2}), tmp_path / "z", 2)
    assert all(h["z_loss"] > 1e-3 for h in z.history)  # z_loss * log(Z)^2 with log Z ~ 4
    np.testing.assert_allclose(z.history[0]["loss"], plain.history[0]["loss"], atol=1e-6)

    micro = _train(_experiment(microbatches=4), tmp_path / "micro", 1)
    batch = micro.trainer.global_batch(train_job.TokenBatches().__next__())
    with micro.trainer.context():
        jaxpr = micro.trainer.jitted_train_step.trace(micro.state, batch).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [4]
    np.testing.assert_allclose(micro.history[0]["loss"], plain.history[0]["loss"], atol=1e-5)

    nan_data = train_job.TokenBatches(nan_at=2)
    with pytest.raises(FloatingPointError, match="at step 2"):
        _train(_experiment(), tmp_path / "stop", 3, data=nan_data)
    skipped = _train(_experiment(on_nonfinite="skip"), tmp_path / "skip", 3,
                     data=train_job.TokenBatches(nan_at=2))
    assert [h["finite"] for h in skipped.history] == [1, 0, 1]

    for flag in (True, False):
        probe = _Capture()
        _train(_experiment(async_checkpoint=flag, checkpoint_every=1), tmp_path / f"async{flag}", 1,
               hooks=lambda hooks: [probe, *hooks])
        assert probe.run.checkpointer.async_save is flag


def _eval_batches():
    data = train_job.TokenBatches()
    data.index = 40  # rows the 5 training steps never see
    batches = [next(data) for _ in range(2)]
    batches[1]["weights"][:, 8:] = 0  # padding: the second batch counts half
    return batches


def test_evaluation_runs_on_schedule_and_equals_a_hand_forward_pass(tmp_path):
    exp = _experiment(eval_every=2)
    result = _train(exp, tmp_path, 5, eval_data=_eval_batches)
    assert [e["step"] for e in result.eval_history] == [2, 4, 5]
    # by hand: the final params, a plain forward pass, token-weighted cross-entropy
    model = DecoderLM(exp.model(train_job.VOCAB))
    params = jax.device_get(result.state.params)
    nll, count, correct = 0.0, 0.0, 0.0
    for b in _eval_batches():
        logits = np.asarray(model.apply({"params": params}, jnp.asarray(b["inputs"]), deterministic=True).logits,
                            np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        picked = np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]
        nll -= (picked * b["weights"]).sum()
        correct += ((logits.argmax(-1) == b["targets"]) * b["weights"]).sum()
        count += b["weights"].sum()
    final = result.eval_history[-1]
    np.testing.assert_allclose(final["loss"], nll / count, rtol=1e-5)
    np.testing.assert_allclose(final["accuracy"], correct / count, rtol=1e-6)
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines if r["split"] == "eval"] == [2, 4, 5]
    logged = _tensorboard_scalars(tmp_path / "tensorboard")
    for name in ("loss", "accuracy"):
        steps, values = zip(*logged[f"eval/{name}"])
        assert steps == (2, 4, 5)
        np.testing.assert_allclose(values, [e[name] for e in result.eval_history], rtol=1e-6)


def _tensorboard_scalars(directory) -> dict:
    """{tag: [(step, value), ...]} from the TensorBoard event files in `directory`: TFRecord
    framing (length, its CRC, the Event proto, its CRC) read by hand."""
    from tensorboardX.proto.event_pb2 import Event
    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_keep_best_keeps_the_checkpoint_of_the_best_eval(tmp_path):
    scores = {2: 1.0, 4: 3.0, 6: 2.0}
    exp = _experiment(eval_every=2, checkpoint_every=2, keep_checkpoints=3, keep_best="score")
    result = _train(exp, tmp_path, 6, eval_extra=lambda trainer, params, step: {"score": scores[step]})
    assert json.load(open(tmp_path / "best" / "best.json")) == {"metric": "score", "value": 3.0, "step": 4}
    assert sorted(os.listdir(tmp_path / "best")) == ["4", "best.json"]
    abstract = result.trainer.abstract_state
    best, regular = Checkpointer(tmp_path / "best"), Checkpointer(tmp_path / "checkpoints")
    kept, _ = best.restore(abstract)
    at4, _ = regular.restore(abstract, 4)
    at6, _ = regular.restore(abstract, 6)
    best.close(), regular.close()
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), kept.params, at4.params)
    assert all(jax.tree.leaves(same))
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                                kept.params, at6.params)))
    with pytest.raises(ValueError, match="keep_best='score' needs an evaluation"):
        _train(exp, tmp_path / "none", 2)


def test_config_record_and_a_changed_model_on_resume(tmp_path):
    exp = _experiment(checkpoint_every=2)
    first = DecoderLM(exp.model(train_job.VOCAB)).config
    _train(exp, tmp_path, 2, config_dict=exp.record(first))
    recorded = json.load(open(tmp_path / "config.json"))
    assert recorded["microbatches"] == 1 and recorded["model_config"]["d_model"] == 32
    wider = _experiment(checkpoint_every=2, **{"model.overrides.d_model": 64})
    with pytest.raises(CheckpointError, match=r"(?s)checkpoint shape.*config changed.*model_config.d_model: 32 -> 64"):
        _train(wider, tmp_path, 4, config_dict=wider.record(DecoderLM(wider.model(train_job.VOCAB)).config))
    assert json.load(open(tmp_path / "config.json")) == recorded  # the refused run changed nothing
    longer = _experiment(checkpoint_every=2, log_every=2)
    _train(longer, tmp_path, 4, config_dict=longer.record(first))
    assert json.load(open(tmp_path / "config.json")) == recorded
    assert json.load(open(tmp_path / "config.step2.json"))["log_every"] == 2


class _Blocking(Hook):
    def after_step(self, run, step, metrics):
        jax.block_until_ready(run.state)


def test_the_loop_reads_no_result_of_the_last_two_steps(tmp_path):
    """While step N is being dispatched the hooks read only results of steps <= N-2 (the
    non-finite check), except at the logging and final steps: nothing makes the host wait on
    the device before it has queued two more steps."""
    probe = train_job.dispatch_probe()
    train_job.run(str(tmp_path), 9, task=train_job.slow_task(), hooks=lambda hooks: [probe, *hooks],
                  log_every=4, checkpoint_every=0)
    early = sorted({(now, read) for now, read in probe.reads if now - read < 2})
    assert early == [(4, 4), (8, 8), (9, 8), (9, 9)], early  # logs at 4, 8, 9; the end settles 8, 9
    assert {read for _, read in probe.reads} == set(range(1, 10))  # every step checked once or more


@pytest.mark.parametrize("block", [False, True], ids=["loop", "control-blocking-hook"])
def test_host_runs_ahead_of_a_slow_device(tmp_path, block):
    """Timed, with a device-bound step: right after some dispatch the previous step is still
    running (the control, a hook that waits on each step, shows the probe can tell). How far
    ahead XLA:CPU lets the host get varies with load (usually 2 steps: 3 in flight)."""
    probe = train_job.dispatch_probe()
    extra = [_Blocking()] if block else []
    train_job.run(str(tmp_path), 12, task=train_job.slow_task(), hooks=lambda hooks: [probe, *extra, *hooks],
                  log_every=100, checkpoint_every=0)
    assert probe.most == 1 if block else probe.most >= 2, probe.counts


@pytest.mark.parametrize("cls,field,value", [
    ("train", "num_train_steps", 0), ("train", "batch_size", 0), ("train", "microbatches", 0),
    ("train", "log_every", 0), ("train", "keep_checkpoints", 0), ("train", "preemption_check_every", 0),
    ("train", "eval_every", -1), ("train", "checkpoint_every", -1), ("train", "on_nonfinite", "ignore"),
    ("train", "keep_best_mode", "best"), ("train", "peak_flops_per_device", 0.0),
    ("optimizer", "name", "adagrad"), ("optimizer", "schedule", "step"), ("optimizer", "decay_mask", "none"),
    ("optimizer", "learning_rate", 0.0), ("optimizer", "learning_rate", -1e-3), ("optimizer", "b1", 1.0),
    ("optimizer", "b2", -0.1), ("optimizer", "eps", -1.0), ("optimizer", "weight_decay", -0.1),
    ("optimizer", "warmup_steps", -1), ("optimizer", "decay_steps", 0), ("optimizer", "end_lr_factor", 1.5),
    ("optimizer", "noam_d_model", 0), ("optimizer", "clip_grad_norm", 0.0),
])
def test_every_invalid_train_field_is_refused_naming_it(cls, field, value):
    from tfm.train import OptimizerConfig, TrainConfig
    owner = {"train": TrainConfig, "optimizer": OptimizerConfig}[cls]
    with pytest.raises(ValueError, match=rf"{owner.__name__}\.{field} must be .*got {value!r}"):
        owner(**{field: value})


def test_batch_not_divisible_into_microbatches_is_refused():
    from tfm.train import TrainConfig
    with pytest.raises(ValueError, match="TrainConfig.batch_size 6 is not divisible by TrainConfig.microbatches 4"):
        TrainConfig(batch_size=6, microbatches=4)


def test_a_run_recorded_with_flat_execution_fields_resumes(tmp_path):
    """A workdir whose config.json holds the execution settings flat (as before ModelConfig.execution
    grouped them) resumes from its checkpoint, its model_config loads as the same ModelConfig, and
    the run's losses equal an undisturbed run's."""
    from tfm.config import ExecutionConfig, ModelConfig
    exp = _experiment(checkpoint_every=2)
    config = DecoderLM(exp.model(train_job.VOCAB)).config
    _train(exp, tmp_path / "old", 2, config_dict=exp.record(config))
    record = json.load(open(tmp_path / "old" / "config.json"))
    flat = record["model_config"].pop("execution")
    record["model_config"].update(flat)
    record["model"]["overrides"].update({k: v for k, v in flat.items() if k in ("dtype", "scan_layers")})
    json.dump(record, open(tmp_path / "old" / "config.json", "w"))
    assert set(flat) == set(ExecutionConfig.names()) and ModelConfig.from_dict(record["model_config"]) == config
    resumed = _train(exp, tmp_path / "old", 4, config_dict=exp.record(config))
    whole = _train(exp, tmp_path / "whole", 4, config_dict=exp.record(config))
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in resumed.history],
                               [r["loss"] for r in whole.history], rtol=1e-6)
