"""The training streams built by worker processes (reading.in_workers, Grain's mp_prefetch;
translation's `data_workers`): the same pairs as in-process, deterministic, resumed exactly from a
checkpointed state, and a state refused by another worker count."""
import json
from collections import Counter

import numpy as np
import pytest

from experiments import common
from experiments.translation import train
from experiments.translation.configs import base
from experiments.translation.settings import TranslationSettings
from tfm.data import pipeline, sources, synthetic, tokenizers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tfds")
    synthetic.prepare_translation(d, train=300, validation=5, test=5, seed=5)
    return sources.load("synthetic_translate", "train", data_dir=d)


@pytest.fixture(scope="module")
def tok():
    return tokenizers.train_sentencepiece((t for p in synthetic.translation_pairs(500, 0) for t in p), 200)


def pairs(batches) -> Counter:
    """Every packed (source, target) segment of `batches`."""
    out = Counter()
    for b in batches:
        for row in range(len(b["inputs"])):
            src, tgt = b["inputs_segment_ids"][row], b["targets_segment_ids"][row]
            out.update((tuple(b["inputs"][row][src == k]), tuple(b["targets"][row][tgt == k]))
                       for k in range(1, src.max() + 1))
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def test_two_workers_give_the_same_pairs_deterministically_and_resume(corpus, tok):
    """One epoch by 2 workers packs exactly the in-process epoch's pairs (in other rows); the
    stream over epochs is the same twice, and a fresh iterator set to its state mid-stream (JSON
    round-tripped, as checkpoints store it) gives the following batches."""
    def make(workers, **kw):
        return pipeline.seq2seq_dataset(corpus, tok, batch_size=4, max_length=24, seed=2, workers=workers, **kw)

    epoch = dict(num_epochs=1, drop_remainder=False)
    in_process = list(make(0, **epoch))
    by_workers = list(make(2, **epoch))
    assert pairs(by_workers) == pairs(in_process) and sum(pairs(in_process).values()) > 150
    assert len(by_workers) >= len(in_process)

    it = iter(make(2))
    first = [next(it) for _ in range(30)]
    state = json.loads(json.dumps(it.get_state()))
    assert state["workers"] == 2
    want = [next(it) for _ in range(50)]  # past the first epoch (~40 batches)
    it.close()
    again, resumed = iter(make(2)), iter(make(2))
    assert_same([next(again) for _ in range(30)], first)
    resumed.set_state(state)
    assert_same([next(resumed) for _ in range(50)], want)
    again.close()
    resumed.close()


def test_a_state_resumes_only_with_its_worker_count(corpus, tok):
    """A 2-worker state refused by 1 worker and in-process; an in-process state (Grain's own, as
    before workers) refused by 2; the in-process state is unchanged by the wrapper."""
    def make(workers):
        return pipeline.seq2seq_dataset(corpus, tok, batch_size=4, max_length=24, seed=2, workers=workers)

    it = iter(make(0))
    next(it)
    state = it.get_state()
    assert "workers" not in state and state["parent"]["next_index"] > 0
    with pytest.raises(ValueError, match="made by 0 worker processes; 2 would give other batches: resume with 0"):
        iter(make(2)).set_state(state)
    two = {"workers": 2, "stream": {}}
    for workers in (0, 1):
        with pytest.raises(ValueError, match=f"made by 2 worker processes; {workers} would give other batches"):
            iter(make(workers)).set_state(two)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        make(-1)


def test_data_workers_reaches_the_translation_stream(tmp_path):
    """The translation config's data_workers builds the recipe's stream with that many workers
    (its state names them); a negative or unset value fails naming the key."""
    c = base.get_config("runlocal")
    c.spm_sentences, c.data_workers = 2000, 2
    corpus = [{"en": en.encode(), "de": de.encode()} for en, de in synthetic.translation_pairs(3000, seed=3)]
    _, exp, data = train.train_stream(c, str(tmp_path), corpus)
    it = iter(data)
    batch = next(it)
    assert batch["inputs"].shape == (exp.train.batch_size, 40) and batch["weights"].sum() > 0
    assert it.get_state()["workers"] == 2
    it.close()
    for bad in (-1, None):
        c.data_workers = bad
        with pytest.raises(ValueError, match=rf"^data_workers={bad}: the training stream's worker processes"):
            common.settings_of(c, TranslationSettings)
