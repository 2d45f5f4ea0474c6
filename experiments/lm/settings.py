"""The LM experiment's own config keys (beside TrainConfig, model and task)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional


@dataclasses.dataclass(frozen=True)
class LMSettings:
    experiment: ClassVar[str] = "experiments.lm.train"  # the module that trains these recipes
    dataset: str        # tfm.data.sources name: "lm1b" or "synthetic_docs"
    vocab_size: int     # SentencePiece BPE trained on the train split
    seq_len: int
    eval_split: str     # held-out split: lm1b has only train and test
    eval_batches: int   # validation batches per evaluation
    sample_prompt: str
    sample_tokens: int  # tokens sampled after training (greedy, top-k, top-p)
    data_dir: Optional[str] = None  # default <workdir>/data
