"""The long-context experiment's own config keys (beside TrainConfig, model and task)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class LongContextSettings:
    experiment: ClassVar[str] = "experiments.long_context.train"  # the module that trains these recipes
    length: int            # tokens per document (model.overrides.max_len must be at least this)
    train_documents: int   # the training set: documents 0 .. train_documents - 1 of the "train" split
    eval_documents: int    # held-out documents of the "test" split
    near: int              # the report splits held-out accuracy at needles <= near and > near (the window's reach)
