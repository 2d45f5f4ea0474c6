"""Generated scenes and their captions: one to three shapes of one colour, all in one quarter of
the image, described as "two red circles in the top left". Every scene is a pure function of (seed,
split, index), so any host makes the same scene without storing a dataset.

The 144 captions (3 counts x 4 colours x 3 shapes x 4 quarters) are equally likely: a model that
does not see the image can at best guess, one caption in 144.
"""
from __future__ import annotations

import dataclasses

import numpy as np

COUNTS = ("one", "two", "three")
COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.75, 0.2), "blue": (0.15, 0.3, 0.95),
           "yellow": (0.95, 0.85, 0.1)}
SHAPES = ("square", "circle", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
SPLITS = {"train": 0, "test": 1}
CAPTION_WORDS = 7  # every caption: count, colour, shape, "in", "the", row, column
OBJECT = 6          # object side in pixels
SIZE = 32           # images are SIZE x SIZE x 3
SLOT = 8            # a quarter of an image holds 2 x 2 cells of SLOT pixels, one object each
BACKGROUND = 0.25   # grey level, with noise of standard deviation NOISE
NOISE = 0.03


@dataclasses.dataclass(frozen=True)
class Scene:
    count: int   # 1..3
    colour: str
    shape: str
    place: str   # one of PLACES

    @property
    def row(self) -> str:
        return self.place.split()[0]

    @property
    def column(self) -> str:
        return self.place.split()[1]

    @property
    def caption(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{COUNTS[self.count - 1]} {self.colour} {self.shape}{plural} in the {self.place}"


def parse(caption: str):
    """The Scene a caption describes, or None if it is not one of the 144 captions."""
    words = caption.split()
    if len(words) != CAPTION_WORDS or words[3:5] != ["in", "the"] or words[0] not in COUNTS:
        return None
    count = COUNTS.index(words[0]) + 1
    shape = words[2][:-1] if count > 1 and words[2].endswith("s") else words[2]
    place = " ".join(words[5:])
    if words[1] not in COLOURS or shape not in SHAPES or place not in PLACES:
        return None
    scene = Scene(count, words[1], shape, place)
    return scene if scene.caption == caption else None


def _stamp(shape: str) -> np.ndarray:
    """[OBJECT, OBJECT] bool footprint of a shape: a filled square, disc or upward triangle."""
    y, x = np.mgrid[:OBJECT, :OBJECT] + 0.5
    c = OBJECT / 2
    if shape == "square":
        return np.ones((OBJECT, OBJECT), bool)
    if shape == "circle":
        return (y - c) ** 2 + (x - c) ** 2 <= c ** 2
    return np.abs(x - c) <= y / 2  # apex at the top, base along the bottom row


def _region(place: str) -> tuple[slice, slice]:
    """(rows, columns) of a quarter of the image."""
    row, column = place.split()
    half = SIZE // 2
    return (slice(0, half) if row == "top" else slice(half, SIZE),
            slice(0, half) if column == "left" else slice(half, SIZE))


def _corners(rng, count: int, rows: slice, cols: slice) -> list[tuple[int, int]]:
    """Top-left corners of `count` objects in distinct cells of the region's 2 x 2 grid of SLOT-pixel
    cells, each jittered by a pixel, so objects never touch."""
    cells = rng.choice(4, count, replace=False)
    return [(rows.start + SLOT * (c // 2) + int(rng.integers(0, 2)), cols.start + SLOT * (c % 2) + int(rng.integers(0, 2)))
            for c in cells]


def make(seed: int, split: str, index: int) -> tuple[np.ndarray, Scene]:
    """(image [SIZE, SIZE, 3] float32 in about [-0.5, 0.5], scene) number `index` of `split`."""
    rng = np.random.default_rng([seed, SPLITS[split], index])
    scene = Scene(int(rng.integers(1, 4)), str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES)),
                  str(rng.choice(PLACES)))
    image = BACKGROUND + NOISE * rng.standard_normal((SIZE, SIZE, 3))
    stamp = _stamp(scene.shape)
    for y, x in _corners(rng, scene.count, *_region(scene.place)):
        image[y:y + OBJECT, x:x + OBJECT][stamp] = COLOURS[scene.colour]
    return (image - 0.5).astype(np.float32), scene


class CaptionTokenizer:
    """Whole-word ids over the captions' closed vocabulary: 0 pad, 1 bos, 2 eos, then the words."""

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self):
        words = [*COUNTS, *COLOURS, *SHAPES, *(s + "s" for s in SHAPES), "in", "the", "top", "bottom", "left", "right"]
        self.words = ["<pad>", "<bos>", "<eos>", *words]
        self.ids = {w: i for i, w in enumerate(self.words)}

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def decode(self, ids) -> str:
        """Words up to the first eos (pad and bos dropped)."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id):
                out.append(self.words[i])
        return " ".join(out)
