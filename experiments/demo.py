"""`make demo`: a tiny translation Transformer on the generated En->De corpus, on CPU.

    python -m experiments.demo [--workdir=DIR] [--config.KEY=VALUE ...]

Trains the `runlocal` variant of experiments/translation/configs/base.py (any key can be
overridden) in DIR (default: a new temporary directory), then prints BLEU, sample
translations and how to score the run again. Takes a few minutes on two CPU cores.
"""
import tempfile

import tensorflow_datasets as tfds

from experiments import common
from experiments.translation import train
from experiments.translation.configs import base


def demo(config, workdir: str) -> None:
    common.check_workdir(workdir)
    print(f"workdir: {workdir}\ngenerating the En->De corpus and training the vocabulary (nothing is downloaded)...")
    tfds.disable_progress_bar()
    scores = train.train_and_evaluate(config, workdir)
    common.exit_if_preempted(scores, f"run `python -m experiments.demo --workdir={workdir}`")
    n = len(scores["samples"])
    print(f"\nfinal training loss {scores['final_loss']:.3f}; beam-4 decoding: {n} sentences in "
          f"{scores['decode_seconds']:.1f}s ({n / scores['decode_seconds']:.1f} sentences/s, compile included)")
    print(train.report_line(scores) + "\n")
    for src, hyp, ref in scores["samples"][:5]:
        print(f"  EN  {src}\n  OUT {hyp}\n  REF {ref}\n")
    print(f"score it again without training: python -m experiments.translation.evaluate --workdir={workdir}")


def main():
    from absl import flags
    common.define_config_flag(f"{base.__file__}:runlocal")
    flags.DEFINE_string("workdir", None, "where to train (default: a new temporary directory)")
    common.run_cli(lambda argv: demo(flags.FLAGS.config, flags.FLAGS.workdir or tempfile.mkdtemp(prefix="tfm_demo_")))


if __name__ == "__main__":
    main()
