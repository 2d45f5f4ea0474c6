"""BERT fine-tuning on GLUE and SQuAD v1.1 (Devlin et al. 2018, section 4).

    python -m experiments.bert.finetune --config=experiments/bert/configs/glue.py:rte \\
        --init=/ckpt/bert_base --workdir=/tmp/ft/rte --sweep
    python -m experiments.bert.finetune --config=experiments/bert/configs/squad.py \\
        --init=/ckpt/bert_base --workdir=/tmp/ft/squad
    python -m experiments.bert.finetune --config=experiments/bert/configs/glue.py:rte,runlocal \\
        --init=/tmp/bert --workdir=/tmp/bert_ft   # CPU, offline: a generated task (configs/glue.py)

--init is a tfm pretraining workdir (config.json, checkpoints/, vocab.txt: the latest
checkpoint's params) or a Hugging Face BERT directory (BertForPreTraining or BertModel
config.json and weights, vocab.txt). The pretraining heads (MLM, NSP) are dropped, the
pooler is kept (a fresh one where the checkpoint has none), and the task's head is new.
Without --sweep: one run at config.optimizer.learning_rate in workdir. With --sweep: one run
per config.learning_rates entry in workdir/lr_<rate>, then workdir/sweep.json with every
run's dev metrics and the best run by the task's score (the mean of its GLUE metrics; SQuAD
F1), as the paper picks the best learning rate on dev. Runs resume after preemption.

`train_and_evaluate(config, workdir, init)` and `sweep(config, workdir, init)` are importable.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import ClassVar, Optional

import jax
import ml_collections
import numpy as np

from experiments import common
from experiments.bert.glue import GENERATED, Glue
from experiments.bert.squad import Squad
from tfm import convert
from tfm.config import ModelConfig
from tfm.data import pipeline
from tfm.data.tokenizers import WordPieceTokenizer
from tfm.models import EncoderModel
from tfm.train import Task
from tfm.train.init_from import InitFromParams, checkpoint_params
from tfm.train import train_and_evaluate as train_loop


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    experiment: ClassVar[str] = "experiments.bert.finetune"  # the module that trains these recipes
    dataset: str              # "glue/<cola|sst2|mrpc|stsb|qqp|mnli|qnli|rte>", "squad" (v1.1), or
                              # "synthetic_topic_pairs" (generated offline: glue.py's runlocal)
    max_seq_length: int       # paper: 128 for GLUE, 384 for SQuAD
    num_epochs: float         # paper: 3; num_train_steps = int(train features * epochs / batch_size)
    warmup_proportion: float  # paper: 0.1 of the steps (optimizer.warmup_steps must stay 0)
    learning_rates: str       # the --sweep grid, comma-separated (paper: 5e-5,4e-5,3e-5,2e-5)
    doc_stride: int           # SQuAD: tokens between window starts (paper: 128)
    max_query_length: int     # SQuAD: question tokens kept (64)
    n_best_size: int          # SQuAD: start and end candidates per window (20)
    max_answer_length: int    # SQuAD: longest answer in tokens (30)
    max_train_examples: int   # 0 = all; runlocal shrinks it
    max_eval_examples: int    # 0 = all
    data_dir: Optional[str] = None  # TFDS data dir; None: $TFDS_DATA_DIR or ~/tensorflow_datasets
                                    # (<workdir>/data for the generated task)


def base_config(dataset: str, max_seq_length: int, learning_rate: float) -> ml_collections.ConfigDict:
    """The paper's recipe as Google's code runs it: batch 32, 3 epochs, Adam without bias
    correction, weight decay 0.01 (not on LayerNorm scales and biases), eps 1e-6, 10% linear
    warmup then lr * (1 - step / steps) (the decay counts from step 0), gradient clip 1.0."""
    c = common.new_config(FinetuneSettings, Task)
    c.update(dataset=dataset, max_seq_length=max_seq_length, num_epochs=3.0, warmup_proportion=0.1,
             learning_rates="5e-5,4e-5,3e-5,2e-5", doc_stride=128, max_query_length=64, n_best_size=20,
             max_answer_length=30, max_train_examples=0, max_eval_examples=0)
    c.batch_size = 32
    c.num_train_steps = None  # derived from num_epochs
    c.optimizer.update(name="adamw", learning_rate=learning_rate, b1=0.9, b2=0.999, eps=1e-6,
                       weight_decay=0.01, decay_mask="kernels", bias_correction=False, schedule="bert_linear",
                       end_lr_factor=0.0,
                       warmup_steps=0, clip_grad_norm=1.0)
    c.log_every, c.eval_every, c.checkpoint_every, c.keep_checkpoints = 100, 0, 1000, 1
    return c


def runlocal(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The same recipe shrunk for a CPU: 64 training and 16 dev examples, one epoch of batch 8."""
    c.update(max_train_examples=64, max_eval_examples=16, num_epochs=1.0, batch_size=8, log_every=1)
    return c


def data_for(settings: FinetuneSettings, tokenizer: WordPieceTokenizer, workdir: str):
    """The task's data and dev evaluation: a `glue.Glue` or a `squad.Squad`."""
    if settings.dataset.startswith("glue/") or settings.dataset in GENERATED:
        return Glue(settings.dataset, settings, tokenizer, workdir)
    if settings.dataset.partition("/")[0] == "squad":
        return Squad(settings.dataset, settings, tokenizer)
    raise ValueError(f"config.dataset={settings.dataset!r}: expected 'glue/<task>', 'squad' or one of "
                     f"{sorted(GENERATED)}")


# ------------------------------------------------------------------- pretrained checkpoints

PRETRAINING_HEADS = ("mlm_transform", "mlm_norm", "mlm_output", "nsp")  # params dropped for fine-tuning
OPTIONAL_PARAMS = ("pooler",)  # dropped where the task's model has none (the span head reads every token)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    config: ModelConfig        # the encoder, without heads
    params: dict               # numpy arrays: embeddings, encoder, and the pooler where present
    tokenizer: WordPieceTokenizer
    source: str


def load_pretrained(init_dir: str) -> Pretrained:
    """A tfm pretraining workdir or a Hugging Face BERT directory (module doc), with its vocab.txt."""
    if not init_dir or not os.path.isdir(init_dir):
        raise ValueError(f"--init={init_dir!r} is not a directory")
    record_path, vocab = os.path.join(init_dir, "config.json"), os.path.join(init_dir, "vocab.txt")
    if not os.path.exists(record_path):
        raise ValueError(f"{init_dir} has no config.json: expected a tfm pretraining workdir or a "
                         "Hugging Face BERT checkpoint directory")
    if not os.path.exists(vocab):
        raise ValueError(f"{init_dir} has no vocab.txt: put the WordPiece vocabulary the checkpoint "
                         "was trained with there")
    with open(record_path) as f:
        record = json.load(f)
    if "model_config" in record:
        config = _config_from_record(record["model_config"], record_path)
        params, step = checkpoint_params(os.path.join(init_dir, "checkpoints"))
        source = f"tfm checkpoint {init_dir}/checkpoints/{step}"
    else:
        config, params, _ = convert.from_hf(init_dir)
        params, source = jax.tree.map(np.asarray, params), f"Hugging Face checkpoint {init_dir}"
    tokenizer = WordPieceTokenizer.load(vocab)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{vocab} has {tokenizer.vocab_size} tokens but the model embeds only "
                         f"{config.vocab_size}: not the checkpoint's vocabulary")
    params = {k: v for k, v in params.items() if k not in PRETRAINING_HEADS}
    return Pretrained(config.replace(heads=()), params, tokenizer, source)


def init_hook(pretrained: Pretrained) -> InitFromParams:
    """The hook that puts the pretrained params into a fresh run's model (tfm.train.init_from);
    the task's head, and a pooler the checkpoint lacks, keep their random init."""
    return InitFromParams(pretrained.params, source=pretrained.source, optional=OPTIONAL_PARAMS)


def _config_from_record(fields: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: model_config is not a config this tfm reads: {e}") from None


# --------------------------------------------------------------------------------- batches

INPUTS = ("input_ids", "token_type_ids", "attention_mask", "weights")


def train_batches(features: list[dict], batch_size: int, seed: int):
    """Endless shuffled epochs of this process's rows of each global batch (a Grain iterator
    whose state is checkpointed)."""
    ds = pipeline.records(features, shuffle=True, seed=seed, num_epochs=None,
                          process_index=jax.process_index(), process_count=jax.process_count())
    b = pipeline.host_batch_size(batch_size, jax.process_count())
    return iter(pipeline.fixed_batches(ds.to_iter_dataset(), b, drop_remainder=True))


def eval_batches(features: list[dict], batch_size: int):
    """(process-local batch of the model inputs, real rows in the global batch), in order;
    process p holds rows [p*b, (p+1)*b) of each global batch, the last padded (weights 0)."""
    b = pipeline.host_batch_size(batch_size, jax.process_count())
    first = jax.process_index() * b
    for start in range(0, len(features), batch_size):
        rows = features[start:start + batch_size][first:first + b]
        batch = {k: np.zeros((b,) + np.shape(features[0][k]), np.asarray(features[0][k]).dtype) for k in INPUTS}
        for i, row in enumerate(rows):
            for k in INPUTS:
                batch[k][i] = row[k]
        yield batch, min(batch_size, len(features) - start)


def predictor(trainer, batch_size: int):
    """predict(params, features, keys) -> {key: numpy [len(features), ...]} of the model's
    deterministic outputs (keys name `EncoderOutput` fields), jitted with the trainer's shardings."""
    compiled = {}

    def predict(params, features, keys):
        if keys not in compiled:
            def fn(p, batch):
                out = trainer.model.apply({"params": p}, **trainer.task.model_kwargs(batch), deterministic=True)
                return {k: getattr(out, k) for k in keys}
            compiled[keys] = jax.jit(fn, in_shardings=(trainer.param_shardings, trainer.batch_sharding),
                                     out_shardings=trainer.replicated)
        parts = {k: [] for k in keys}
        for batch, real in eval_batches(features, batch_size):
            with trainer.context():
                out = compiled[keys](params, trainer.global_batch(batch))
            for k in keys:
                parts[k].append(np.asarray(out[k])[:real])
        return {k: np.concatenate(v) for k, v in parts.items()}

    return predict


# ------------------------------------------------------------------------------------ runs

def _experiment(config, settings: FinetuneSettings, data, learning_rate: Optional[float]):
    """The resolved experiment: num_train_steps from the epochs, warmup from its proportion."""
    raw = config.to_dict() if hasattr(config, "to_dict") else json.loads(json.dumps(config))
    steps = max(1, int(len(data.train) * settings.num_epochs / raw["batch_size"]))
    optimizer = raw["optimizer"]
    if settings.warmup_proportion and optimizer.get("warmup_steps"):
        raise ValueError("set either config.warmup_proportion or config.optimizer.warmup_steps, not both "
                         "(warmup_proportion=0 turns the derived warmup off)")
    if settings.warmup_proportion:
        optimizer["warmup_steps"] = int(steps * settings.warmup_proportion)
    if learning_rate is not None:
        optimizer["learning_rate"] = learning_rate
    return common.resolve(raw, FinetuneSettings, data.task_cls, model_from_checkpoint=True, num_train_steps=steps)


def finetune_model_config(pretrained: Pretrained, data, overrides: dict, settings: FinetuneSettings) -> ModelConfig:
    """The pretrained encoder with the task's head, config.model.overrides applied."""
    try:
        config = pretrained.config.replace(heads=data.heads, num_labels=data.num_labels, **overrides)
    except TypeError as e:
        raise ValueError(f"config.model.overrides: {e}") from None
    if settings.max_seq_length > config.max_len:
        raise ValueError(f"config.max_seq_length={settings.max_seq_length} exceeds the model's "
                         f"max_len={config.max_len} (its position table)")
    return config


def fine_tune(config, workdir: str, pretrained: Pretrained, data, learning_rate: Optional[float] = None) -> dict:
    """One fine-tuning run; {"task", "learning_rate", "steps", "dev" (final dev metrics),
    "preempted", "params" (the fine-tuned params)}."""
    settings = common.settings_of(config, FinetuneSettings)
    exp = _experiment(config, settings, data, learning_rate)
    mcfg = finetune_model_config(pretrained, data, exp.overrides, settings)
    predict = {}

    def evaluate(trainer, params, step):
        if "fn" not in predict:
            predict["fn"] = predictor(trainer, exp.train.batch_size)
        return data.evaluate(lambda features, keys: predict["fn"](params, features, keys))

    result = train_loop(exp.train, workdir, model=EncoderModel(mcfg), task=exp.task,
                        train_data=train_batches(data.train, exp.train.batch_size, exp.train.seed),
                        eval_extra=evaluate, hooks=lambda defaults: [init_hook(pretrained)] + defaults,
                        config_dict={**exp.record(mcfg), "init": pretrained.source})
    dev = {k: v for k, v in (result.eval_history[-1] if result.eval_history else {}).items() if k != "step"}
    return {"task": settings.dataset, "learning_rate": exp.train.optimizer.learning_rate,
            "steps": exp.train.num_train_steps, "dev": dev, "preempted": result.preempted,
            "params": result.state.params}


def train_and_evaluate(config, workdir: str, init: str) -> dict:
    """One run at config.optimizer.learning_rate (fine_tune's dict)."""
    settings = common.settings_of(config, FinetuneSettings)
    pretrained = load_pretrained(init)
    return fine_tune(config, workdir, pretrained, data_for(settings, pretrained.tokenizer, workdir))


def learning_rates(settings: FinetuneSettings) -> list[float]:
    try:
        rates = [float(r) for r in settings.learning_rates.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"config.learning_rates={settings.learning_rates!r} is not a comma-separated "
                         "list of numbers") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"config.learning_rates={settings.learning_rates!r} needs positive rates")
    return rates


def sweep(config, workdir: str, init: str) -> dict:
    """One run per learning rate (data prepared once). workdir/sweep.json gets {"task", "init",
    "score", "runs" (without params), "best"}; returned with "best_params" and "preempted"."""
    settings = common.settings_of(config, FinetuneSettings)
    rates = learning_rates(settings)
    pretrained = load_pretrained(init)
    data = data_for(settings, pretrained.tokenizer, workdir)
    runs, best, best_params = [], None, None
    for rate in rates:
        print(f"--- {settings.dataset}: learning rate {rate:g} ({len(runs) + 1} of {len(rates)})", flush=True)
        run = fine_tune(config, os.path.join(workdir, f"lr_{rate:g}"), pretrained, data, rate)
        params = run.pop("params")
        runs.append(run)
        if run["preempted"]:
            return {"task": settings.dataset, "runs": runs, "preempted": True}
        if best is None or run["dev"][data.score_name] > best["dev"][data.score_name]:
            best, best_params = run, params
        del params  # only the best run's params stay in memory
    summary = {"task": settings.dataset, "init": pretrained.source, "score": data.score_name, "runs": runs,
               "best": best}
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "sweep.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return {**summary, "best_params": best_params, "preempted": False}


def report(result: dict) -> None:
    if jax.process_index():
        return
    runs = result["runs"] if "runs" in result else [result]
    for r in runs:
        metrics = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["dev"].items()))
        print(f"{r['task']} lr {r['learning_rate']:g} ({r['steps']} steps): {metrics}", flush=True)
    if "best" in result:
        best = result["best"]
        print(f"best {result['score']}: {best['dev'][result['score']]:.2f} at lr {best['learning_rate']:g}", flush=True)


def main():
    from absl import flags
    flags.DEFINE_string("init", None, "tfm pretraining workdir or Hugging Face BERT directory (with vocab.txt)")
    flags.DEFINE_bool("sweep", False, "run every config.learning_rates entry and report the best on dev")
    flags.mark_flag_as_required("init")
    FLAGS = flags.FLAGS
    common.main(lambda config, workdir: (sweep if FLAGS.sweep else train_and_evaluate)(config, workdir, FLAGS.init),
                report)


if __name__ == "__main__":
    main()
