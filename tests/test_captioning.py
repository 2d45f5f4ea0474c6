"""The captioning experiment (experiments/captioning) and the optimizer's `frozen` option it uses:
generated scenes checked against what a brute-force reader finds in their pixels, the caption
scores against hand counts, and Llama 3.2's recipe (a text-only run's decoder, frozen) end to end."""
import itertools
import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from scipy import ndimage

from experiments.captioning import scenes, train
from experiments.captioning.configs import tiny
from tfm.models import DecoderLM
from tfm.models.presets import tiny as tiny_model
from tfm.train import LMTask, OptimizerConfig, TrainConfig, Trainer
from tfm.train.init_from import checkpoint_params


def _read(image):
    """The scene a brute-force reader sees: pixels far from the background, their colour (nearest),
    connected components (count), fill of a component's box (square 1, disc ~0.8, triangle ~0.6)
    and which quarter of the image holds them all."""
    rgb = image + 0.5
    ink = np.abs(rgb - scenes.BACKGROUND).max(-1) > 0.3
    colour = min(scenes.COLOURS, key=lambda c: np.abs(rgb[ink] - scenes.COLOURS[c]).sum())
    labels, count = ndimage.label(ink)
    fill = np.mean([(labels[box] == i + 1).mean() for i, box in enumerate(ndimage.find_objects(labels))])
    shape = "square" if fill > 0.95 else "circle" if fill > 0.7 else "triangle"
    ys, xs = np.nonzero(ink)
    h = image.shape[0] // 2
    row = "top" if ys.max() < h else "bottom" if ys.min() >= h else None
    column = "left" if xs.max() < h else "right" if xs.min() >= h else None
    return count, colour, shape, f"{row} {column}"


def test_every_caption_says_what_its_image_shows():
    for i in range(60):
        image, s = scenes.make(3, "test", i)
        assert _read(image) == (s.count, s.colour, s.shape, s.place), (i, s)


def test_scenes_are_a_function_of_seed_split_and_index_and_cover_every_caption():
    a, b = scenes.make(0, "train", 7), scenes.make(0, "train", 7)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert not np.array_equal(a[0], scenes.make(0, "test", 7)[0])
    seen = {scenes.make(0, "train", i)[1].caption for i in range(2000)}
    assert len(seen) == 144


def test_the_grammar_round_trips_and_anything_else_does_not_parse():
    tok = scenes.CaptionTokenizer()
    for n, c, s, place in itertools.product((1, 2, 3), scenes.COLOURS, scenes.SHAPES, scenes.PLACES):
        scene = scenes.Scene(n, c, s, place)
        assert scenes.parse(scene.caption) == scene
        assert tok.decode(tok.encode(scene.caption) + [tok.eos_id, 5]) == scene.caption
    for bad in ("one red squares in the top left", "two red square in the top left", "one red square in the top",
                "one red square at the top left", "one red square in the left top", ""):
        assert scenes.parse(bad) is None, bad


def test_caption_scores_equal_hand_counts():
    truth = [scenes.Scene(2, "red", "circle", "top left"), scenes.Scene(1, "blue", "square", "top right"),
             scenes.Scene(3, "green", "triangle", "bottom left"), scenes.Scene(1, "yellow", "circle", "bottom right")]
    hyps = [truth[0].caption, "one red square in the top right", "three green triangles",
            "one yellow circle in the top right"]
    got = train.caption_scores(hyps, truth)
    # exact: 1 of 4; the third does not parse (0 on every attribute)
    assert got["caption_accuracy"] == 0.25
    assert [got[f"{a}_accuracy"] for a in ("count", "colour", "shape", "row", "column")] == [0.75, 0.5, 0.75, 0.5, 0.75]
    assert 0 < got["sacrebleu"] < 100 and abs(train.caption_scores([t.caption for t in truth], truth)["sacrebleu"] - 100) < 1e-9


def test_a_resumed_iterator_gives_the_batches_an_uninterrupted_one_would():
    settings = train.CaptionSettings(train_scenes=100, eval_scenes=8, use_images=True)
    tok = scenes.CaptionTokenizer()
    straight = train.TrainBatches(settings, tok, batch_size=4, seed=1)
    batches = [next(straight) for _ in range(3)]
    resumed = train.TrainBatches(settings, tok, batch_size=4, seed=1)
    resumed.set_state(straight.get_state() | {"step": 2})
    third = next(resumed)
    assert all(np.array_equal(third[k], batches[2][k]) for k in batches[2])
    assert batches[2]["images"].shape == (4, 1, 1, 32, 32, 3)
    assert not np.array_equal(batches[1]["images"], batches[2]["images"])


def _frozen_run(frozen):
    cfg = tiny_model("llama")
    y = np.random.default_rng(0).integers(1, 64, (8, 9)).astype(np.int32)
    batch = {"inputs": y[:, :-1], "targets": y[:, 1:]}
    tcfg = TrainConfig(num_train_steps=2, batch_size=8, optimizer=OptimizerConfig(frozen=frozen, weight_decay=0.1))
    trainer = Trainer(DecoderLM(cfg), LMTask(), tcfg).setup(batch)
    state = trainer.init_state()
    before = jax.device_get(state.params)  # the step donates the state's buffers
    for _ in range(2):
        state, _ = trainer.train_step(state, trainer.global_batch(batch))
    return before, state


def test_frozen_parameters_never_move_and_hold_no_optimizer_state():
    before, after = _frozen_run("decoder/layer_0/|embed/")
    old, new = (traverse_util.flatten_dict(p, sep="/") for p in (before, jax.device_get(after.params)))
    frozen = [k for k in old if k.startswith(("decoder/layer_0/", "embed/"))]
    assert frozen and len(frozen) < len(old)
    for k in old:
        assert np.array_equal(old[k], new[k]) == (k in frozen), k
    moments = sum(x.size for x in jax.tree.leaves(after.opt_state) if np.ndim(x))
    trainable = sum(old[k].size for k in old if k not in frozen)
    assert moments == 2 * trainable  # Adam's two moments, for the trainable parameters only


@pytest.mark.parametrize("frozen, message", [
    ("vision/", "matches no parameter"), (".*", "matches every parameter"), ("(", "is not a regular expression"),
    ("", "must be None or a non-empty regular expression")])
def test_a_frozen_pattern_that_cannot_mean_what_was_meant_is_refused(frozen, message):
    with pytest.raises(ValueError, match=message):
        _frozen_run(frozen)


def test_variants_and_runlocal_name_one_config():
    assert tiny.get_config("runlocal").to_dict() == tiny.get_config("").to_dict()
    assert tiny.get_config("llama32,runlocal").to_dict() == tiny.get_config("llama32").to_dict()
    assert tiny.get_config("text_only").use_images is False and tiny.get_config("llama32").optimizer.frozen
    with pytest.raises(ValueError, match="unknown"):
        tiny.get_config("llama3")


def test_llama32_recipe_starts_from_the_text_only_run_and_trains_only_the_image_side(tmp_path):
    """text_only for two steps, then llama32 from it: every frozen text parameter still equals the
    text-only run's, the cross-attention layers moved; both write their scores and the grid of captions."""
    steps = dict(num_train_steps=2, eval_scenes=32, log_every=1, eval_every=0, checkpoint_every=2)
    text_dir, vision_dir = str(tmp_path / "text"), str(tmp_path / "vision")
    config = tiny.get_config("text_only")
    config.update(steps)
    text_scores = train.train_and_evaluate(config, text_dir)
    config = tiny.get_config("llama32")
    config.update(dict(steps, init_from=text_dir))
    scores = train.train_and_evaluate(config, vision_dir)
    for got in (text_scores, scores):
        assert set(train.chance_scores()) <= set(got) and len(got["samples"]) == 32
    assert all(os.path.getsize(os.path.join(d, "captions.png")) > 10_000 for d in (text_dir, vision_dir))
    text = traverse_util.flatten_dict(checkpoint_params(os.path.join(text_dir, "checkpoints"))[0], sep="/")
    both = traverse_util.flatten_dict(checkpoint_params(os.path.join(vision_dir, "checkpoints"))[0], sep="/")
    trained = ("vision/", "projector/", "text/decoder/layer_1/", "text/decoder/layer_3/")
    assert {k.split("/")[0] for k in set(both) - set(text)} == {"vision", "projector"}
    frozen = [k for k in both if not k.startswith(trained)]
    assert frozen and all(np.array_equal(text[k], both[k]) for k in frozen)
    cross = [k for k in text if k.startswith(trained)]
    assert sum(not np.array_equal(text[k], both[k]) for k in cross) > len(cross) // 2  # trained: most moved
    assert all(both[f"text/decoder/layer_{i}/{gate}"] != 0 for i in (1, 3) for gate in ("cross_gate", "ffn_gate"))
