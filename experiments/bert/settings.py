"""The BERT pretraining experiment's own config keys (beside TrainConfig, model and task).

The fine-tuning experiments read a pretraining workdir through these names (config.json).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional


@dataclasses.dataclass(frozen=True)
class BertSettings:
    experiment: ClassVar[str] = "experiments.bert.pretrain"  # the module that trains these recipes
    dataset: str                  # "synthetic_topics" / "synthetic_docs" (generated offline), a TFDS name
                                  # ("wikipedia", "wikipedia/20230601.en"), or "" (text_dirs only)
    text_dirs: str                # comma-separated plain-text corpus directories (BooksCorpus
                                  # stand-in): a document per file or blank-line separated; "" none
    synthetic_documents: int      # documents generated for the synthetic datasets
    eval_documents: int           # held-out documents: the lowest hashes of their keys among the
                                  # first chunks (seeded order) holding 8x as many; not trained on
    chunk_documents: int          # dataset documents per chunk (NSP's random B comes from the chunk)
    chunk_bytes: int              # text_dirs bytes per chunk
    shuffle_chunks: int           # chunks whose instances are shuffled together (the shuffle buffer)
    vocab_documents: int          # documents (seeded sample) the vocabulary is trained on
    eval_batches: int             # held-out batches per evaluation
    tokenizer: str                # "wordpiece" (BERT, uncased) or "byte_bpe" (RoBERTa)
    vocab_size: int               # trained vocabulary size (ignored when vocab_path is set)
    max_seq_length: int           # phase 1 (paper: 128)
    max_predictions_per_seq: int  # phase 1 (paper: 20)
    masked_lm_prob: float         # paper: 0.15
    short_seq_prob: float         # paper: 0.1
    dupe_factor: int              # pair sets created with different splits (masks are dynamic)
    whole_word_masking: bool      # all pieces of a word masked together
    next_sentence: bool           # True: BERT pairs + NSP head; False: RoBERTa full sentences, MLM only
    phase2_start_step: int        # 0: one phase; else phase 2 (longer sequences) from this step
    phase2_max_seq_length: int    # paper: 512
    phase2_max_predictions_per_seq: int  # paper: 80
    phase2_batch_size: Optional[int] = None  # None: batch_size (LAMB recipe: 32k after 64k)
    vocab_path: Optional[str] = None  # an existing vocab.txt (or a dir holding one); else trained
    data_dir: Optional[str] = None    # TFDS data dir; default <workdir>/data for generated data
    data_workers: int = 0             # processes building the next shuffle windows' examples; 0: the
                                      # training process. The batches are the same whatever the count.

    def __post_init__(self):
        if not isinstance(self.data_workers, int) or self.data_workers < 0:
            raise ValueError(f"data_workers={self.data_workers}: the training stream's worker processes, "
                             ">= 0 (0: in the training process)")
