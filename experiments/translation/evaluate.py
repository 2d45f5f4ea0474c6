"""Evaluate a trained translation model without training: average its last checkpoints,
translate a split, write the translations, print both BLEUs and the sacreBLEU signature.

    python -m experiments.translation.evaluate --workdir=DIR [--average_last=N] [--split=test]

Everything else (model, vocabulary, dataset, beam, alpha) comes from DIR/config.json.
"""
from __future__ import annotations

import json
import os

import jax

from experiments import common
from experiments.translation import train
from experiments.translation.settings import TranslationSettings
from tfm.data import pipeline, sources, tokenizers
from tfm.models import EncoderDecoder
from tfm.train import Seq2SeqTask, Trainer
from tfm.train.checkpoint import CheckpointError, Checkpointer
from tfm.train.metrics import last_logged_step
from tfm.train.workdir_lock import require_filesystem_path


def require_final_checkpoint(workdir: str, keep: int) -> None:
    """Refuses a workdir whose newest checkpoint is older than the last step its run logged:
    scoring it would report an earlier model than the run's."""
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)
    newest = checkpointer.latest_step()
    checkpointer.close()
    logged = last_logged_step(workdir)
    if newest is None or newest < logged:
        found = "none" if newest is None else f"step {newest}"
        raise CheckpointError(
            f"the newest checkpoint in {workdir}/checkpoints is {found}, but the run logged step {logged} "
            "(metrics.jsonl): its final state was not saved, so its score would not be the run's. Run its "
            "training command again on this workdir (it resumes and saves), then evaluate")


def evaluate(workdir: str, average_last: int | None = None, split: str = "test") -> dict:
    """Scores (as train.checkpoint_bleu) of `split`; translations in workdir/translations.<split>.txt."""
    require_filesystem_path(workdir)
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} the --workdir of a translation run?")
    with open(path) as f:
        raw = {k: v for k, v in json.load(f).items() if k != "model_config"}
    derived = {"batch_size": jax.device_count()} if raw.get("batch_size") is None else {}  # not used here
    try:
        exp = common.resolve(raw, TranslationSettings, Seq2SeqTask, **derived)
    except ValueError as e:
        raise ValueError(f"{path} is not a translation run's config ({e})") from e
    require_final_checkpoint(workdir, exp.train.keep_checkpoints)
    s = exp.settings
    tok = tokenizers.SentencePieceTokenizer.load(os.path.join(workdir, f"spm_{s.vocab_size}.model"))
    source = dict(zip(("train", "validation", "test"), train.load_sources(s, workdir)))[split]
    examples = [source[i] for i in range(min(s.eval_examples, len(source)))]
    model = EncoderDecoder(exp.model(tok.vocab_size))
    example = next(iter(pipeline.seq2seq_dataset(examples, tok, batch_size=jax.device_count(),
                                                 max_length=s.max_length, shuffle=False, num_epochs=1,
                                                 drop_remainder=False)))
    abstract = Trainer(model, exp.task, exp.train).setup(example).abstract_state
    scores = train.checkpoint_bleu(model, abstract, workdir, s, tok, examples, split, keep=exp.train.keep_checkpoints,
                             average_last=average_last)
    out = os.path.join(workdir, f"translations.{split}.txt")
    with open(out, "w") as f:
        f.writelines(hyp + "\n" for _, hyp, _ in scores["samples"])
    scores["translations"] = out
    return scores


def main():
    from absl import flags

    flags.DEFINE_string("workdir", None, "the --workdir of a translation training run")
    flags.DEFINE_integer("average_last", None, "checkpoints to average (default: the config's average_last)")
    flags.DEFINE_enum("split", "test", ["train", "validation", "test"], "the split to translate")
    flags.mark_flags_as_required(["workdir"])

    def run(argv):
        del argv
        scores = evaluate(flags.FLAGS.workdir, flags.FLAGS.average_last, flags.FLAGS.split)
        print(f"{train.report_line(scores)}; translations in {scores['translations']}")

    common.run_cli(run)


if __name__ == "__main__":
    main()
