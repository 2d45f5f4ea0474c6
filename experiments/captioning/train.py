"""Image captioning with the Llama 3.2 Vision layout on generated scenes, against a text-only baseline.

    python -m experiments.captioning.train --config=experiments/captioning/configs/tiny.py --workdir=/tmp/tfm_caption
    python -m experiments.captioning.train --config=experiments/captioning/configs/tiny.py:text_only \
        --workdir=/tmp/tfm_caption_text
    python -m experiments.captioning.train --config=experiments/captioning/configs/tiny.py:llama32 \
        --workdir=/tmp/tfm_caption_llama32   # after text_only: its decoder, frozen

A `VisionLanguageModel` (tiled ViT encoder, projector, text decoder with gated cross-attention
layers) learns to caption scenes (`scenes.py`); the text-only baseline is the same model trained
on the same captions without ever seeing an image. Both are scored on held-out scenes by greedy
captions: exact caption accuracy, each attribute's accuracy, and sacreBLEU. The scores go to
<workdir>/captions.json and a grid of held-out scenes with their captions to <workdir>/captions.png.

`train_and_evaluate(config, workdir)` is importable (tests, notebooks).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure  # not pyplot: a notebook's inline backend stays as it is

from experiments import common
from experiments.captioning import scenes
from experiments.captioning.settings import CaptionSettings
from experiments.translation.bleu import SACREBLEU, sacrebleu_with_signature
from tfm import decode
from tfm.data import pipeline
from tfm.models import VisionLanguageModel
from tfm.train import ImageTextTask, LMTask
from tfm.train import train_and_evaluate as train_loop
from tfm.train.init_from import InitFromParams, checkpoint_params

CAPTION_LEN = scenes.CAPTION_WORDS + 1  # tokens in and out: bos + words, words + eos
ATTRIBUTES = ("count", "colour", "shape", "row", "column")  # the place is "<row> <column>"
GRID = 4  # captions.png shows GRID x GRID held-out scenes


def caption_batch(settings: CaptionSettings, tok: scenes.CaptionTokenizer, split: str, indices, seed: int) -> dict:
    """The model inputs of scenes `indices` of `split`: inputs/targets/weights [B, CAPTION_LEN] and,
    with settings.use_images, images [B, 1, 1, SIZE, SIZE, 3] (one tile, aspect-ratio layout 1 = 1x1)."""
    made = [scenes.make(seed, split, int(i)) for i in indices]
    ids = np.array([[tok.bos_id] + tok.encode(s.caption) + [tok.eos_id] for _, s in made], np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": np.ones(ids[:, 1:].shape, np.float32)}
    if settings.use_images:
        B = len(made)
        batch.update(images=np.stack([im for im, _ in made])[:, None, None],
                     aspect_ratio_ids=np.ones((B, 1), np.int32), aspect_ratio_mask=np.ones((B, 1, 1), np.int32))
    return batch


class TrainBatches:
    """This process's rows of global batch `step`: scene indices drawn from the training set by
    (seed, step). The state is the step, so a resumed run sees exactly the batches it would have."""

    def __init__(self, settings: CaptionSettings, tok, batch_size: int, seed: int):
        self.settings, self.tok, self.seed, self.step = settings, tok, seed, 0
        self.rows = pipeline.host_batch_size(batch_size, jax.process_count())
        self.batch_size, self.first = batch_size, jax.process_index() * self.rows

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        drawn = np.random.default_rng([self.seed, self.step]).integers(0, self.settings.train_scenes, self.batch_size)
        self.step += 1
        return caption_batch(self.settings, self.tok, "train", drawn[self.first:self.first + self.rows], self.seed)

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])


def caption_scores(hypotheses: list[str], truth: list[scenes.Scene]) -> dict:
    """caption_accuracy (exact), <attribute>_accuracy (a caption that is not one of the grammar's
    scores 0 on all), and sacreBLEU against the one true caption."""
    parsed = [scenes.parse(h) for h in hypotheses]
    out = {"caption_accuracy": float(np.mean([h == s.caption for h, s in zip(hypotheses, truth)]))}
    for a in ATTRIBUTES:
        out[f"{a}_accuracy"] = float(np.mean([p is not None and getattr(p, a) == getattr(s, a)
                                              for p, s in zip(parsed, truth)]))
    out[SACREBLEU], out["sacrebleu_signature"] = sacrebleu_with_signature(hypotheses, [s.caption for s in truth])
    return out


def chance_scores() -> dict:
    """What a captioner that never sees the image can expect at best: every caption is equally likely."""
    return {"caption_accuracy": 1 / (len(scenes.COUNTS) * len(scenes.COLOURS) * len(scenes.SHAPES) * len(scenes.PLACES)),
            "count_accuracy": 1 / len(scenes.COUNTS), "colour_accuracy": 1 / len(scenes.COLOURS),
            "shape_accuracy": 1 / len(scenes.SHAPES), "row_accuracy": 1 / 2, "column_accuracy": 1 / 2}


def caption(model, params, tok, batch: dict) -> list[str]:
    """Greedy captions of a caption_batch's scenes (of its images, when it has them), as one jitted
    program (eagerly, the cache's set-up and the prompt's step compile op by op)."""
    B = len(batch["inputs"])
    images = {k: jnp.asarray(batch[k]) for k in ("images", "aspect_ratio_ids", "aspect_ratio_mask") if k in batch}
    prompt = jnp.full((B, 1), tok.bos_id, jnp.int32)
    out = jax.jit(lambda params, prompt, images: decode.sample_lm(
        model, params, prompt, CAPTION_LEN, jax.random.PRNGKey(0), conditioning=images, greedy=True,
        eos_id=tok.eos_id, pad_id=tok.pad_id))(params, prompt, images)
    return [tok.decode(row) for row in np.asarray(out).tolist()]


def save_grid(path: str, images, hypotheses: list[str], truth: list[scenes.Scene], n: int, title: str) -> None:
    """A PNG of the first n x n scenes, each titled with its caption (green: exact, red: wrong)."""
    fig = Figure(figsize=(2.4 * n, 2.6 * n))
    axes = fig.subplots(n, n)
    for ax, image, h, s in zip(np.ravel(axes), images, hypotheses, truth):
        ax.imshow(np.clip(image + 0.5, 0, 1))
        ax.set_title(h.replace(" in the ", "\nin the ") or "(empty)", fontsize=8,
                     color="green" if h == s.caption else "red")
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def _init_hook(settings: CaptionSettings):
    """The hook that puts a text-only run's decoder into this model (Llama 3.2 starts from a trained LM)."""
    if settings.init_from is None:
        return None
    params, step = checkpoint_params(os.path.join(settings.init_from, "checkpoints"))
    return InitFromParams(params, source=f"{settings.init_from} (step {step})")


def train_and_evaluate(config, workdir: str) -> dict:
    """Train, then caption the held-out scenes; returns the scores (caption_scores plus "chance",
    "samples" [(caption, true caption)] and "preempted")."""
    exp = common.resolve(config, CaptionSettings, ImageTextTask)
    s, tcfg = exp.settings, exp.train
    tok = scenes.CaptionTokenizer()
    mcfg = exp.model(tok.vocab_size)
    vision = mcfg.multimodal.vision
    if vision is None or vision.image_size != scenes.SIZE or vision.multimodal.max_num_tiles != 1:
        raise ValueError(f"model.overrides.multimodal.vision must be a one-tile image encoder of "
                         f"image_size={scenes.SIZE} (the generated scenes' size)")
    model = VisionLanguageModel(mcfg)
    task = exp.task if s.use_images else LMTask(**dataclasses.asdict(exp.task))
    init = _init_hook(s)
    held_out = np.arange(s.eval_scenes)

    def eval_data():
        rows = pipeline.host_batch_size(tcfg.batch_size, jax.process_count())
        for start in range(0, s.eval_scenes - tcfg.batch_size + 1, tcfg.batch_size):
            first = start + jax.process_index() * rows
            yield caption_batch(s, tok, "test", held_out[first:first + rows], tcfg.seed)

    result = train_loop(tcfg, workdir, model=model, task=task, train_data=TrainBatches(s, tok, tcfg.batch_size, tcfg.seed),
                        eval_data=eval_data, hooks=(lambda hooks: [init, *hooks]) if init else None,
                        config_dict=exp.record(mcfg))
    if result.preempted:  # stopped on a signal: nothing below would describe a finished run
        return {"preempted": True}
    batch = caption_batch(s, tok, "test", held_out, tcfg.seed)
    truth = [scenes.make(tcfg.seed, "test", int(i))[1] for i in held_out]
    hypotheses = caption(model, result.state.params, tok, batch)
    scores = {**caption_scores(hypotheses, truth), "chance": chance_scores(),
              "samples": [(h, t.caption) for h, t in zip(hypotheses, truth)], "preempted": False}
    if jax.process_index() == 0:
        name = "with images" if s.use_images else "text only (baseline)"
        with open(os.path.join(workdir, "captions.json"), "w") as f:
            json.dump(scores, f, indent=1)
        images = np.stack([scenes.make(tcfg.seed, "test", int(i))[0] for i in held_out[:GRID ** 2]])
        save_grid(os.path.join(workdir, "captions.png"), images, hypotheses, truth, GRID,
                  f"{name}: {scores['caption_accuracy']:.1%} of {s.eval_scenes} held-out captions exact")
        print(report(scores, name))
    return scores


def report(scores: dict, name: str) -> str:
    """One line per run: the held-out scores beside chance."""
    chance = scores["chance"]
    parts = [f"{k} {scores[k]:.3f} (chance {chance[k]:.3f})" for k in chance]
    return f"{name}: " + ", ".join(parts) + f", {SACREBLEU} {scores[SACREBLEU]:.1f}"


if __name__ == "__main__":
    common.main(train_and_evaluate)
