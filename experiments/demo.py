"""`make demo`: a tiny translation Transformer on the generated En->De corpus, on CPU.

Trains the `runlocal` variant of experiments/translation/configs/base.py, then prints BLEU and
sample translations. Takes a few minutes on two CPU cores.
"""
import sys
import tempfile

import tensorflow_datasets as tfds
from absl import logging

from experiments.translation import train
from experiments.translation.configs import base


def main():
    workdir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="tfm_demo_")
    print(f"workdir: {workdir}\ngenerating the En->De corpus and training the vocabulary (nothing is downloaded)...")
    tfds.disable_progress_bar()
    logging.set_verbosity(logging.WARNING)
    scores = train.train_and_evaluate(base.get_config("runlocal"), workdir)
    n = len(scores["samples"])
    print(f"\nfinal training loss {scores['final_loss']:.3f}; beam-4 decoding: {n} sentences in "
          f"{scores['decode_seconds']:.1f}s ({n / scores['decode_seconds']:.1f} sentences/s, compile included)")
    print(train.bleu_lib.report(scores, scores["test_set"]) + "\n")
    for src, hyp, ref in scores["samples"][:5]:
        print(f"  EN  {src}\n  OUT {hyp}\n  REF {ref}\n")


if __name__ == "__main__":
    main()
