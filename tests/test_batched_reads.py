"""Record reads in blocks (reading.BlockReadIterDataset over sources.read): the batches, their
order, the host split and the checkpointed state are those of Grain's one-record-a-call reads
(`to_iter_dataset`, the path before), on a generated array_record corpus and on TFDS mock_data
with wmt14's real split names."""
import json

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

import tfds_mock
from tfm.data import pipeline, reading, sources, synthetic, tokenizers

tfds.disable_progress_bar()


class CountingCalls:
    """`source` with the calls to it counted: `__getitem__` and `__getitems__` (keys per call)."""

    def __init__(self, source):
        self.source, self.single, self.batched = source, 0, []

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        self.single += 1
        return self.source[i]

    def __getitems__(self, keys):
        self.batched.append(len(keys))
        return self.source.__getitems__(keys)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tfds")
    synthetic.prepare_translation(d, train=400, validation=5, test=5, seed=3)
    return sources.load("synthetic_translate", "train", data_dir=d)


@pytest.fixture(scope="module")
def tok():
    return tokenizers.train_sentencepiece((t for p in synthetic.translation_pairs(500, 0) for t in p), 200)


def one_record_reads(monkeypatch):
    """The pipelines as they were: Grain's `to_iter_dataset`, one `source[i]` a record (patched
    where the pipelines call it)."""
    monkeypatch.setattr(pipeline, "BlockReadIterDataset",
                        lambda ds, read_options: ds.to_iter_dataset(read_options))


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def records_read(state: dict) -> int:
    """The record position in a pipeline's (nested) iterator state."""
    return state["next_index"] if "next_index" in state else records_read(state["parent"])


def streams(make, count=6, resume_at=3):
    """`count` batches of `make()`, the iterator state after `resume_at`, and the batches a fresh
    iterator set to that (JSON round-tripped) state gives."""
    it = iter(make())
    batches = [next(it) for _ in range(resume_at)]
    state = json.loads(json.dumps(it.get_state()))
    batches += [next(it) for _ in range(count - resume_at)]
    resumed = iter(make())
    resumed.set_state(state)
    return batches, state, [next(resumed) for _ in range(count - resume_at)]


@pytest.mark.parametrize("hosts", [1, 2])
def test_block_reads_give_the_one_record_batches_and_state(corpus, tok, monkeypatch, hosts):
    """Packed translation batches over epochs (400 pairs; past the first epoch): equal to
    the one-record reads', the same state mid-stream, resumed exactly from it; two hosts see disjoint
    pairs. The array_record source is read in blocks, never a record a call."""
    counted = CountingCalls(corpus)

    def make(h):
        return lambda: pipeline.seq2seq_dataset(counted, tok, batch_size=4 * hosts, max_length=24, seed=7,
                                                process_index=h, process_count=hosts)

    new = [streams(make(h), count=70, resume_at=62) for h in range(hosts)]
    assert counted.single == 0 and max(counted.batched) == reading.READ_BLOCK
    with monkeypatch.context() as m:
        one_record_reads(m)
        old = [streams(make(h), count=70, resume_at=62) for h in range(hosts)]
    assert counted.single > 0
    for (batches, state, resumed), (old_batches, old_state, _) in zip(new, old):
        assert_same(batches, old_batches)
        assert state == old_state and 400 // hosts < records_read(state) < 3 * 400 // hosts  # past an epoch
        assert_same(resumed, batches[62:])
    if hosts == 2:  # the source sides packed in each host's first 20 batches (within its first epoch)
        seen = [[tuple(ids[seg == k]) for b in batches[:20] for ids, seg in zip(b["inputs"], b["inputs_segment_ids"])
                 for k in range(1, seg.max() + 1)] for batches, _, _ in new]
        assert min(map(len, seen)) > 60 and len(set(seen[0] + seen[1])) == len(seen[0] + seen[1])


def test_lm_stream_with_threads_or_none_is_the_one_record_stream(corpus, tok, monkeypatch):
    """Unpacked LM batches (no shuffle), blocks read in the consuming thread (READ_OPTIONS) or by 2
    or 3 threads (2 or 3 blocks ahead): the
    one-record reads' batches; resuming inside a block gives the rest of it."""
    def make(options):
        def build():
            return pipeline.lm_dataset(corpus, tok, batch_size=3, seq_len=16, text_key="de", pack=False,
                                       shuffle=False, num_epochs=1, drop_remainder=False, read_options=options)
        return build

    runs = [streams(make(o), count=9, resume_at=5) for o in
            (reading.READ_OPTIONS, grain.ReadOptions(num_threads=2, prefetch_buffer_size=512),
             grain.ReadOptions(num_threads=3, prefetch_buffer_size=700))]
    with monkeypatch.context() as m:
        one_record_reads(m)
        want, want_state, _ = streams(make(reading.READ_OPTIONS), count=9, resume_at=5)
    assert records_read(want_state) == 15
    for batches, state, resumed in runs:
        assert_same(batches, want)
        assert state == want_state
        assert_same(resumed, want[5:])
    whole = list(pipeline.lm_dataset(corpus, tok, batch_size=3, seq_len=16, text_key="de", pack=False,
                                     shuffle=False, num_epochs=1, drop_remainder=False))
    assert len(whole) == -(-400 // 3)
    np.testing.assert_array_equal(whole[-1]["weights"][1:], 0)  # 400 = 3 * 133 + 1: padded rows


def test_block_reader_skips_filtered_records_and_refuses_bad_state():
    """Over a plain list with a filter: the kept elements in order across block edges (block 4),
    the state counts records read, not kept; an out-of-range state and a bad block fail."""
    ds = pipeline.records(list(range(23)), shuffle=False, seed=0, num_epochs=1).filter(lambda x: x % 3 == 0)
    reader = reading.BlockReadIterDataset(ds, block=4, read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
    it = iter(reader)
    assert [next(it) for _ in range(4)] == [0, 3, 6, 9] and it.get_state() == {"next_index": 10}
    assert list(it) == [12, 15, 18, 21]
    it.set_state({"next_index": 7})
    assert list(it) == [9, 12, 15, 18, 21]
    with pytest.raises(IndexError, match="out of range for 23 records"):
        it.set_state({"next_index": 24})
    with pytest.raises(ValueError, match="block must be at least 1"):
        reading.BlockReadIterDataset(ds, block=0)


def test_mock_reads_take_the_sources_batched_path():
    """`sources.read` on a mocked wmt14 source is one `__getitems__` call into the reader: TFDS's own
    mock fails there (its reader's `__getitems__` is unbound), tfds_mock's reads the records."""
    with tfds.testing.mock_data(num_examples=4), pytest.raises(TypeError, match="record_key"):
        sources.read(sources.load("wmt14", "train"), [0, 1])
    with tfds_mock.mock_data(num_examples=4):
        source = sources.load("wmt14", "train")
        reader = source.data_source
        reads = []
        batched = reader.__getitems__
        reader.__dict__["__getitems__"] = lambda keys: reads.append(list(keys)) or batched(keys)
        assert sources.read(source, [3, 1]) == [source[3], source[1]] and reads == [[3, 1]]


def test_mock_wmt14_reads_in_blocks_and_samples(tok, monkeypatch):
    """TFDS mock_data with wmt14's splits (str features) through sources.load: `sources.read` and
    `sources.sample` read what `source[i]` does; the seq2seq stream equals the one-record reads'
    and resumes exactly."""
    with tfds_mock.mock_data(num_examples=40):
        for split in ("train", "validation", "test"):
            source = sources.load("wmt14", split)
            keys = [7, 0, 39, 7]
            assert sources.read(source, keys) == [source[k] for k in keys]
            chosen = list(sources.sample(source, 9, seed=len(split), read_batch=4))
            assert len(chosen) == 9 and all(isinstance(ex["en"], str) for ex in chosen)
            assert len({ex["en"] for ex in chosen}) == 9
            assert chosen == list(sources.sample(source, 9, seed=len(split)))  # any read_batch
            assert {ex["en"] for ex in chosen} <= {source[i]["en"] for i in range(40)}
        source = sources.load("wmt14", "train")

        def make():
            return pipeline.seq2seq_dataset(source, tok, batch_size=2, max_length=64, seed=1)

        batches, state, resumed = streams(make, count=8, resume_at=5)
        with monkeypatch.context() as m:
            one_record_reads(m)
            want, want_state, _ = streams(make, count=8, resume_at=5)
    assert_same(batches, want)
    assert state == want_state and batches[0]["weights"].sum() > 0
    assert_same(resumed, batches[5:])
