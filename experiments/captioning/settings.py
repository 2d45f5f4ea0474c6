"""The captioning experiment's own config keys (beside TrainConfig, model and task)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional


@dataclasses.dataclass(frozen=True)
class CaptionSettings:
    experiment: ClassVar[str] = "experiments.captioning.train"  # the module that trains these recipes
    train_scenes: int        # the training set: scenes 0 .. train_scenes - 1 of the "train" split
    eval_scenes: int         # held-out scenes of the "test" split: eval loss and the caption scores
    use_images: bool = True  # False: the text-only baseline (the same model, never shown an image)
    init_from: Optional[str] = None  # a text-only run's workdir: its text decoder initialises this model
