"""`make demo`: a tiny translation Transformer on the generated En->De corpus, on CPU.

    python -m experiments.demo [--workdir=DIR] [--config.KEY=VALUE ...]

Trains the `runlocal` variant of experiments/translation/configs/base.py (any key can be
overridden) in DIR, then prints BLEU, sample translations and how to score the run again.
Without --workdir it trains in a temporary directory, removed at the end. Takes a few
minutes on two CPU cores.
"""
import sys
import tempfile
from typing import Optional

import tensorflow_datasets as tfds

from experiments import common
from experiments.translation import train
from experiments.translation.configs import base


def demo(config, workdir: Optional[str]) -> None:
    """Trains and reports in `workdir`; None: in a temporary directory, removed after."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="tfm_demo_") as scratch:
            _train_and_report(config, scratch, kept=False)
    else:
        common.check_workdir(workdir)
        _train_and_report(config, workdir, kept=True)


def _train_and_report(config, workdir: str, kept: bool) -> None:
    print(f"workdir: {workdir}\ngenerating the En->De corpus and training the vocabulary (nothing is downloaded)...")
    tfds.disable_progress_bar()
    scores = train.train_and_evaluate(config, workdir)
    if common.preempted(scores) and not kept:
        print("stopped by a signal; the temporary workdir is removed (give --workdir=DIR to keep a run you can "
              "resume)", flush=True)
        sys.exit(common.EXIT_PREEMPTED)
    common.exit_if_preempted(scores, f"run `python -m experiments.demo --workdir={workdir}`")
    n = len(scores["samples"])
    print(f"\nfinal training loss {scores['final_loss']:.3f}; beam-4 decoding: {n} sentences in "
          f"{scores['decode_seconds']:.1f}s ({n / scores['decode_seconds']:.1f} sentences/s, compile included)")
    print(train.report_line(scores) + "\n")
    for src, hyp, ref in scores["samples"][:5]:
        print(f"  EN  {src}\n  OUT {hyp}\n  REF {ref}\n")
    if kept:
        print(f"score it again without training: python -m experiments.translation.evaluate --workdir={workdir}")
    else:
        print(f"{workdir} is removed; to keep a run and score it again, give --workdir=DIR")


def main():
    from absl import flags
    common.define_config_flag(f"{base.__file__}:runlocal")
    flags.DEFINE_string("workdir", None, "where to train (default: a temporary directory, removed at the end)")
    common.run_cli(lambda argv: demo(flags.FLAGS.config, flags.FLAGS.workdir))


if __name__ == "__main__":
    main()
