"""What every experiment shares: one config schema, the vocabulary, the entry point.

An experiment config is an ml_collections ConfigDict made by `new_config(Settings, Task)`:
its keys are exactly
  - every TrainConfig field at the top level (`optimizer` and `mesh` nested), defaults
    from the dataclasses themselves;
  - `model.preset` (a tfm.models.presets name) and `model.overrides` (ModelConfig fields; RoPE's
    nested: `model.overrides.rope.theta`);
  - `task.*`: the Task's loss fields (label_smoothing, z_loss, moe_aux_weight, indexer_loss_weight);
  - the experiment's own `Settings` fields (dataset, vocab_size, ...), which the recipe sets;
  - `experiment`: the module that trains the recipe (`Settings.experiment` declares it), so a
    recipe names its experiment (experiments.preflight reads it).
The dict is locked, so a misspelt key fails where it is written (in the config file or as
`--config.KEY=VALUE`); `resolve` checks the same for plain dicts and builds the dataclasses.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import tempfile
import typing
from typing import Any, Callable, Iterable, NoReturn, Optional

import jax
import ml_collections
import tensorflow_datasets as tfds

from tfm import parallel
from tfm.config import ExecutionConfig, ModelConfig
from tfm.data import tokenizers
from tfm.data.sources import DatasetNotPreparedError
from tfm.models import presets
from tfm.train import TrainConfig
from tfm.train.checkpoint import CheckpointError
from tfm.train.metrics import interactive_output
from tfm.train.workdir_lock import WorkdirLockedError, require_filesystem_path

_NESTED = {"optimizer", "mesh"}  # TrainConfig fields that are dataclasses themselves


def _field_type(hint):
    """The concrete type of a field annotation (Optional[X] -> X)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union else hint


def _config_of(cls, *, with_defaults: bool = True, into=None) -> ml_collections.ConfigDict:
    """A ConfigDict (or `into`) with one typed entry per field of dataclass `cls`."""
    c = ml_collections.ConfigDict() if into is None else into
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            c[f.name] = _config_of(hints[f.name])
            continue
        value = f.default if with_defaults and f.default is not dataclasses.MISSING else None
        c[f.name] = ml_collections.FieldReference(value, field_type=_field_type(hints[f.name]))
    return c


def new_config(settings_cls, task_cls) -> ml_collections.ConfigDict:
    """The locked schema of an experiment (module doc); the recipe fills in its values."""
    c = _config_of(settings_cls, with_defaults=False, into=_config_of(TrainConfig))
    c.experiment = settings_cls.experiment
    c.model = ml_collections.ConfigDict({"preset": ml_collections.FieldReference(None, field_type=str),
                                         "overrides": ml_collections.ConfigDict()})
    c.task = _config_of(task_cls)
    c.lock()
    c.model.overrides.unlock()  # any ModelConfig field; checked by presets.build
    return c


def _build(cls, values: dict, where: str):
    """Dataclass `cls` from `values`, naming any unknown or unset key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    _check_keys(values, names, where)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            value = _build(hints[f.name], dict(value), f"{where}.{f.name}")
        elif value is None and f.default is dataclasses.MISSING:
            raise ValueError(f"{where}.{f.name} is not set")
        kwargs[f.name] = value
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in kwargs and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: {missing} not set")
    return cls(**kwargs)


def _check_keys(values, valid, where: str) -> None:
    for key in values:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}.{key} is not a config key{hint}; valid keys: {sorted(valid)}")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A resolved experiment config: `model(vocab_size)` builds its ModelConfig."""
    train: TrainConfig
    task: Any
    settings: Any
    preset: str
    overrides: dict
    raw: dict

    def model(self, vocab_size: int) -> ModelConfig:
        return presets.build(self.preset, vocab_size, self.overrides)

    def record(self, model_config: ModelConfig) -> dict:
        """The resolved config for workdir/config.json: every key, and the ModelConfig built."""
        return {**self.raw, "model_config": dataclasses.asdict(model_config)}


@dataclasses.dataclass(frozen=True)
class Blueprint:
    """What an experiment trains, built without data (experiments.preflight): the model, the
    task, the TrainConfig and, per batch shape the run trains on (BERT's two phases), a global
    batch of jax.ShapeDtypeStruct with the pipeline's keys, shapes and dtypes."""
    model: Any
    task: Any
    train: TrainConfig
    batches: dict


_FLAG_PREFIXES = {"TrainConfig": "--config.", "ModelConfig": "--config.model.overrides."}


def flag_of(field: str) -> str:
    """The command-line flag that sets a tfm field ("ModelConfig.execution.remat_policy") in an
    experiment config: TrainConfig's fields at the top level, ModelConfig's under model.overrides."""
    owner, _, path = field.partition(".")
    if owner not in _FLAG_PREFIXES or not path:
        raise ValueError(f"{field!r} is not a field an experiment config sets; it sets "
                         f"{' and '.join(f'{o}.<field>' for o in _FLAG_PREFIXES)}")
    return _FLAG_PREFIXES[owner] + path


def settings_of(config, settings_cls):
    """Only the experiment's own settings (what it needs before the TrainConfig is complete)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    keys = [f.name for f in dataclasses.fields(settings_cls)]
    return _build(settings_cls, {k: raw[k] for k in keys if k in raw}, "config")


def resolve(config, settings_cls, task_cls, *, model_from_checkpoint: bool = False, **derived) -> Experiment:
    """The dataclasses behind an experiment config (a ConfigDict or a plain dict). `derived`:
    TrainConfig values the experiment computed (e.g. batch_size from a token budget); the
    config must leave those unset (None), so that a value a user sets is never overridden.
    model_from_checkpoint: the model comes from a checkpoint (fine-tuning), so
    config.model.preset must stay unset; model.overrides still apply."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for key, value in derived.items():
        if raw.get(key) is not None:
            raise ValueError(f"config.{key}={raw[key]!r} is set, but this experiment derives it ({value!r}) "
                             f"from other keys; unset it (None) or turn the derivation off")
    train_keys = [f.name for f in dataclasses.fields(TrainConfig)]
    settings_keys = [f.name for f in dataclasses.fields(settings_cls)]
    _check_keys(raw, train_keys + settings_keys + ["model", "task", "experiment"], "config")
    model = dict(raw.get("model") or {})
    _check_keys(model, ["preset", "overrides"], "config.model")
    if model_from_checkpoint and model.get("preset"):
        raise ValueError(f"config.model.preset={model['preset']!r} is set, but this experiment takes "
                         "its model from a checkpoint; unset it")
    if not model_from_checkpoint and not model.get("preset"):
        raise ValueError(f"config.model.preset is not set; choose from {sorted(presets.PRESETS)}")
    exp = Experiment(
        train=_build(TrainConfig, {**{k: raw[k] for k in train_keys if k in raw}, **derived}, "config"),
        task=_build(task_cls, dict(raw.get("task") or {}), "config.task"),
        settings=settings_of(raw, settings_cls),
        preset=model["preset"], overrides=dict(model.get("overrides") or {}), raw=raw)
    if not model_from_checkpoint:  # every model value checked now, before any data is read or generated
        exp.model(getattr(exp.settings, "vocab_size", None) or 32_000)
    return exp


def sentencepiece(workdir: str, texts: Iterable[str], vocab_size: int) -> tokenizers.SentencePieceTokenizer:
    """The experiment's SentencePiece model: loaded from the workdir, or trained on `texts` (and
    saved there by process 0; training is deterministic, so every host gets the same vocabulary)."""
    path = os.path.join(workdir, f"spm_{vocab_size}.model")
    if os.path.exists(path):
        return tokenizers.SentencePieceTokenizer.load(path)
    os.makedirs(workdir, exist_ok=True)
    return tokenizers.train_sentencepiece(texts, vocab_size, path=path if jax.process_index() == 0 else None)


def on_first_process(prepare: Callable[[], object]) -> None:
    """Runs `prepare` (e.g. writing a generated dataset) on process 0 only; every process waits
    until it is done, so hosts sharing a filesystem never write the same files at once."""
    if jax.process_index() == 0:
        prepare()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("tfm: data prepared")


EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT after saving; run the same command to resume
EXIT_ERROR = 1       # a clear, one-line error on stderr (bad flag or config, workdir, checkpoint, NaN, dataset not prepared)
ERRORS = (ValueError, CheckpointError, WorkdirLockedError, FloatingPointError, DatasetNotPreparedError,
          OSError)  # what `fail` reports


def fail(error) -> NoReturn:
    """Writes `error: <message on one line>` to stderr and exits with EXIT_ERROR."""
    sys.stderr.write(f"error: {' '.join(str(error).split())}\n")  # one write: no thread splits the line
    sys.stderr.flush()
    os._exit(EXIT_ERROR)  # skip interpreter teardown: background threads would print noise


def check_workdir(workdir: str) -> None:
    """Refuses, before anything is written there, a URL, a file, or a directory that cannot be
    created or written."""
    require_filesystem_path(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir} is a file, not a directory; give a directory (created if missing)")
    try:
        os.makedirs(workdir, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()
    except OSError as e:
        raise ValueError(f"--workdir={workdir} cannot be created or written ({e.strerror}); "
                         "give a directory you can write to") from e


def _config_arg(argv: list[str]) -> Optional[str]:
    """The value of the last `--config=FILE[:arg]` argument, if any."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return values[-1] if values else None


_OVERRIDE = re.compile(r"^--?(no)?config\.([^=]+)")  # --config.KEY=VALUE (and absl's --[no]config.KEY)


def _without_overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if not _OVERRIDE.match(a)]


def _model_levels() -> dict:
    """{where: its keys} for the config levels that take a dataclass's fields, whether or not the
    recipe sets any: ModelConfig's under model.overrides, a nested group's (rope, ...) below."""
    hints = typing.get_type_hints(ModelConfig)
    levels = {"--config.model.overrides": [f.name for f in dataclasses.fields(ModelConfig)]
              + list(ExecutionConfig.names())}  # named flat too: presets.build moves them into execution
    for f in dataclasses.fields(ModelConfig):
        group = _field_type(hints[f.name])
        if dataclasses.is_dataclass(group):
            levels[f"--config.model.overrides.{f.name}"] = [g.name for g in dataclasses.fields(group)]
    return levels


def _check_override(config: ml_collections.ConfigDict, path: list[str], levels: dict) -> None:
    """ValueError naming the valid keys of the level where `--config.<path>` leaves the schema;
    a model group (`model.overrides.rope`) the recipe does not set is added, empty."""
    node, where = config, "--config"
    for key in path:
        valid = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        _check_keys([key], levels.get(where, valid), where)
        where = f"{where}.{key}"
        if where in levels and isinstance(node, ml_collections.ConfigDict) and node.get(key) is None:
            node[key] = ml_collections.ConfigDict()
        node = node.get(key) if isinstance(node, ml_collections.ConfigDict) else None


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
    """Applies `--config.KEY=VALUE` arguments to the ConfigDict ml_collections loaded, each KEY
    checked first (a misspelt one is named with the valid keys of its level). A ModelConfig
    field the recipe leaves unset (`model.overrides.FIELD`, `model.overrides.rope.FIELD`) is
    added; its VALUE is read as a Python literal, else taken as a string. Other values are
    parsed by ml_collections as the type the config gives them."""
    from absl import flags
    from ml_collections import config_flags
    levels = _model_levels()
    with config.unlocked():  # every key is checked: only model fields are added
        for arg in overrides:
            _check_override(config, _OVERRIDE.match(arg).group(2).split("."), levels)
        values = flags.FlagValues()
        config_flags.DEFINE_config_dict("config", config, flag_values=values, lock_config=False,
                                        accept_new_attributes=True, sys_argv=["", *overrides])
        values(["", *overrides])


def define_config_flag(default: Optional[str] = None) -> None:
    """`--config=FILE[:arg]`, locked. ml_collections loads the file (a default at once); the
    command line's `--config.KEY=VALUE` overrides are applied to what it loaded by `parse_flags`."""
    from ml_collections import config_flags
    try:
        config_flags.DEFINE_config_file("config", default, "experiment config file", lock_config=True,
                                        sys_argv=_without_overrides(sys.argv))
    except Exception as e:  # noqa: BLE001 - ml_collections raises many types
        fail(e)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (an `app.run` flags_parser), then the `--config.KEY=VALUE` overrides
    (`apply_overrides`), with every failure reported by `fail`: a missing config file, a misspelt
    `--config.KEY` (naming the valid keys), any other flag error."""
    from absl import flags
    config_arg = _config_arg(argv)
    path = config_arg and config_arg.split(":", 1)[0]
    if path and not os.path.isfile(path):
        fail(f"--config file {path} not found (run from the repository root, or give its full path)")
    has_config = "config" in flags.FLAGS
    overrides = [a for a in argv if _OVERRIDE.match(a)] if has_config else []
    try:
        rest = flags.FLAGS(_without_overrides(argv) if has_config else argv)
        if overrides:
            apply_overrides(flags.FLAGS.config, overrides)
    except Exception as e:  # noqa: BLE001 - absl and ml_collections raise many types
        fail(e)
    return rest


def run_cli(command: Callable[[list[str]], None]) -> None:
    """`app.run(command)` with WARNING-level logs, TFDS's progress bars only on a terminal (a log
    would collect their escape codes), and every error in ERRORS reported by `fail`."""
    from absl import app, logging

    def run(argv):
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        if not interactive_output():
            tfds.disable_progress_bar()
        try:
            command(argv)
        except ERRORS as e:
            fail(e)

    app.run(run, flags_parser=parse_flags)


def main(train_and_evaluate: Callable, report: Callable[[object], None] = lambda result: None):
    """`--config=FILE[:arg] --workdir=DIR [--config.KEY=VALUE ...]`: join the multi-host job,
    train, report. Exit status 0: finished; EXIT_PREEMPTED: saved and stopped by a signal;
    EXIT_ERROR: one line on stderr says what failed and what to do."""
    from absl import flags

    define_config_flag()
    flags.DEFINE_string("workdir", None, "checkpoints, logs and the vocabulary go here")
    flags.mark_flags_as_required(["config", "workdir"])

    def run(argv):
        del argv
        parallel.initialize()  # automatic on TPU pods and SLURM; TFM_* variables elsewhere
        check_workdir(flags.FLAGS.workdir)  # before anything (a vocabulary) is written there
        try:
            result = train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
        except Exception:  # in a multi-host job, maybe the trace of a lost process: the watch names it
            parallel.await_lost_peer()
            raise
        exit_if_preempted(result)
        report(result)

    run_cli(run)


def exit_if_preempted(result, resume: str = "run the same command") -> None:
    """Says how to resume and exits with EXIT_PREEMPTED if `result` stopped early on a signal."""
    if preempted(result):
        print(f"preempted: the checkpoint is saved; {resume} to resume", flush=True)
        sys.exit(EXIT_PREEMPTED)


def preempted(result) -> bool:
    """Whether a train_and_evaluate result (a TrainResult or a dict) stopped early on a signal."""
    return bool(result.get("preempted") if isinstance(result, dict) else getattr(result, "preempted", False))
