"""The translation experiment's own config keys (beside TrainConfig, model and task)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional


@dataclasses.dataclass(frozen=True)
class TranslationSettings:
    experiment: ClassVar[str] = "experiments.translation.train"  # the module that trains these recipes
    dataset: str             # tfm.data.sources name: "wmt14" or "synthetic_translate"
    synthetic_pairs: int     # size of the generated corpus (synthetic_translate only)
    vocab_size: int          # shared SentencePiece vocabulary
    spm_sentences: int       # sentences it is trained on: both sides of a seeded sample of
                             # spm_sentences / 2 training pairs (no pass over the corpus)
    max_length: int          # longest source/target in tokens; longer pairs are dropped
    tokens_per_batch: int    # > 0: rows per step chosen for ~this many tokens per side (then
                             # batch_size stays None); 0: batch_size rows
    eval_examples: int       # held-out pairs for eval loss (validation) and final BLEU (test)
    eval_bleu_examples: int  # validation pairs decoded for BLEU at each eval; 0: none
    decode_length: int
    beam_size: int           # 1: greedy
    alpha: float             # GNMT length penalty
    average_last: int        # final BLEU with the average of the last k checkpoints
    data_dir: Optional[str] = None  # default <workdir>/data
    data_workers: int = 0    # processes building the training batches (Grain mp_prefetch); 0: the
                             # training process. Batches depend on it: resume with the same count.

    def __post_init__(self):
        if not isinstance(self.data_workers, int) or self.data_workers < 0:
            raise ValueError(f"data_workers={self.data_workers}: the training stream's worker processes, "
                             ">= 0 (0: in the training process)")
