"""Random-access data sources: TFDS array_record datasets read with `tfds.data_source`.

No TensorFlow is needed to read. The real datasets must first be prepared as array_record
(`tfds build wmt14_translate/de-en --file_format=array_record`, which needs the `tf`
extra); the local corpora are prepared by `tfm.data.synthetic` and read here the same way.

    src = load("wmt14_translate/de-en", "train")        # {"en": bytes, "de": bytes}
    src = load("synthetic_translate", "train", data_dir=d)  # same features, local corpus
    docs = documents(load("wikipedia", "train"))         # list[list[str]] sentences (small splits)

Corpora too large for host memory are read a chunk at a time by `tfm.data.documents`.

Examples are dicts of numpy values; text features are `bytes` (`str` under
`tfds.testing.mock_data`): use `as_text`. Read many examples at once with `read` (one
`__getitems__` call: ~30 us an example in a call of thousands, against ~1.3 ms for a call of
one); the Grain pipelines (`tfm.data.pipeline`) do.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds


@dataclasses.dataclass(frozen=True)
class _Family:
    register: str | None  # module whose import registers the TFDS builder
    default_config: str | None
    splits: tuple[str, ...] | None  # the real dataset's splits (None: vary by config)
    prepare: str | None = None  # how to prepare it; None: `tfds build` (a TFDS catalog dataset)


class DatasetNotPreparedError(FileNotFoundError):
    """A dataset that is not prepared as array_record where it is looked for; the message says
    how to prepare it."""


_THREE = ("train", "validation", "test")
_LOCAL = "tfm.data.synthetic"  # the generated datasets' module
# TFDS name (the part before '/') -> how to load it. The split names are the real builders'
# (TFDS mock_data serves any split name, so they are checked here).
_FAMILIES = {
    "wmt14_translate": _Family("tensorflow_datasets.translate", "de-en", _THREE),  # newstest2013, 2014
    "lm1b": _Family("tensorflow_datasets.text", None, ("train", "test")),
    "wikipedia": _Family("tensorflow_datasets.text", "20230601.en", ("train",)),
    # Not in the TFDS catalog: read from a prepared directory (TFDS `builder_from_files`).
    "bookcorpus": _Family(None, None, ("train",), "a TFDS builder of your own (it is not in the TFDS catalog)"),
    "glue": _Family("tensorflow_datasets.text", None, None),
    "squad": _Family("tensorflow_datasets.question_answering", "v1.1", ("train", "validation")),
    "tfm_synthetic_translate": _Family(_LOCAL, None, _THREE, f"{_LOCAL}.prepare_translation(data_dir)"),
    "tfm_synthetic_docs": _Family(_LOCAL, None, _THREE, f"{_LOCAL}.prepare_documents(data_dir)"),
    "tfm_synthetic_topics": _Family(_LOCAL, None, _THREE, f"{_LOCAL}.prepare_topical_documents(data_dir)"),
    "tfm_synthetic_topic_pairs": _Family(_LOCAL, None, _THREE, f"{_LOCAL}.prepare_topic_pairs(data_dir)"),
}
ALIASES = {"wmt14": "wmt14_translate/de-en", "synthetic_translate": "tfm_synthetic_translate",
           "synthetic_docs": "tfm_synthetic_docs", "synthetic_topics": "tfm_synthetic_topics",
           "synthetic_topic_pairs": "tfm_synthetic_topic_pairs"}


def resolve(name: str) -> str:
    """Full TFDS name with config for a short name, e.g. 'wikipedia' -> 'wikipedia/20230601.en'."""
    name = ALIASES.get(name, name)
    family, _, config = name.partition("/")
    if family not in _FAMILIES:
        raise ValueError(f"unknown dataset {name!r}; known: "
                         f"{sorted(_FAMILIES) + sorted(ALIASES)} (with an optional /config)")
    config = config or _FAMILIES[family].default_config
    if family == "glue" and not config:
        raise ValueError("glue needs a task, e.g. 'glue/mrpc'")
    return f"{family}/{config}" if config else family


def load(name: str, split: str, *, data_dir: str | os.PathLike | None = None):
    """The array_record data source of one split: `len()`, `[i] -> dict` (Grain-compatible).

    Raises ValueError for an unknown name or split and DatasetNotPreparedError (a
    FileNotFoundError) when the dataset is not prepared as array_record under `data_dir`
    (default: $TFDS_DATA_DIR or ~/tensorflow_datasets), whichever way TFDS reports it.
    """
    full = resolve(name)
    family = _FAMILIES[full.partition("/")[0]]
    base_split = split.partition("[")[0]  # "train[:10%]" slices the train split
    if family.splits is not None and base_split not in family.splits:
        raise ValueError(f"{full} has no split {base_split!r}; its splits are {list(family.splits)}")
    if family.register:
        importlib.import_module(family.register)
    data_dir = os.fspath(data_dir) if data_dir is not None else None
    try:
        source = tfds.data_source(full, split=split, data_dir=data_dir, download=False)
    # TFDS's forms of "not prepared": no builder directory (DatasetNotFoundError), one in another
    # file format or with no dataset_info.json (NotImplementedError, AssertionError), missing
    # files (FileNotFoundError), and a dataset_info.json without the split (KeyError: an
    # interrupted preparation).
    except (AssertionError, NotImplementedError, FileNotFoundError, KeyError,
            tfds.core.DatasetNotFoundError) as e:
        where = data_dir or tfds.core.constants.DATA_DIR
        how = family.prepare or f"`tfds build {full} --file_format=array_record --data_dir={where}` (needs the tf extra)"
        raise DatasetNotPreparedError(f"dataset {full} split {split!r} is not prepared as array_record "
                                      f"under {where}; prepare it with {how}") from e
    return source


def as_text(value: Any) -> str:
    """A TFDS text feature as `str` (bytes in real data, str under mock_data)."""
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def texts(source: Sequence[dict], keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Every `keys` feature of every example as `str`, e.g. for tokenizer training."""
    return (as_text(source[i][k]) for i in range(len(source)) for k in keys)


def sample(source: Sequence[dict], count: int, *, seed: int = 0, read_batch: int = 4096) -> Iterator[dict]:
    """`count` examples of `source` (all of them when it has fewer) at seeded random indices, in
    index order: a bounded, deterministic sample (the same on every host) read by random access,
    with no pass over the split (e.g. to train a tokenizer). Sources with `__getitems__` (TFDS's
    array_record) are read `read_batch` indices a call: a call costs ~1 ms, a record ~30 us."""
    if count < 1:
        raise ValueError(f"the sample needs at least one example, got {count}")
    chosen = np.sort(np.random.default_rng(seed).choice(len(source), size=min(count, len(source)), replace=False))
    indices = [int(i) for i in chosen]
    return (ex for start in range(0, len(indices), read_batch) for ex in read(source, indices[start:start + read_batch]))


def read(source: Sequence[dict], keys: Sequence[int]) -> list[dict]:
    """The examples at `keys`, in order: one `__getitems__(keys)` call where the source has it
    (TFDS's array_record sources), else `source[k]` for each key (lists, other sources)."""
    keys = [int(k) for k in keys]
    if hasattr(source, "__getitems__"):
        return list(source.__getitems__(keys))
    return [source[k] for k in keys]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def split_sentences(text: str) -> list[str]:
    """Lines, then sentence ends ('. ' before a capital), without empty pieces."""
    return [s.strip() for line in text.split("\n")
            for s in _SENTENCE_END.split(line) if s.strip()]


def documents(source: Sequence[dict], text_key: str = "text") -> list[list[str]]:
    """All examples of `source` as documents (lists of sentences), skipping empty ones.

    Reads the whole split into memory: for small splits (pretraining streams its corpus with
    `tfm.data.documents`)."""
    docs = (split_sentences(as_text(source[i][text_key])) for i in range(len(source)))
    return [d for d in docs if d]
