"""Grain pipelines: packing, padding, host sharding, checkpointable state, TFDS mock_data."""
import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

import tfds_mock
from tfm.data import pipeline, sources, synthetic, tokenizers

SEQ2SEQ_KEYS = {"inputs", "inputs_segment_ids", "inputs_positions", "targets_in", "targets",
                "targets_segment_ids", "targets_positions", "weights"}
LM_KEYS = {"inputs", "targets", "segment_ids", "positions", "weights"}

tfds.disable_progress_bar()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tfds")
    synthetic.prepare_translation(d, train=300, validation=20, test=20)
    synthetic.prepare_documents(d, train=60, validation=5, test=5)
    return d


@pytest.fixture(scope="module")
def translate(data_dir):
    return sources.load("synthetic_translate", "train", data_dir=data_dir)


@pytest.fixture(scope="module")
def tok(translate):
    return tokenizers.train_sentencepiece(sources.texts(translate, ("en", "de")), 250)


def _segments(tokens, segment_ids, positions):
    """Per row, the token tuple of every segment; checks positions restart at 0."""
    out = []
    for row_t, row_s, row_p in zip(tokens, segment_ids, positions):
        ids = row_s[row_s > 0]
        assert (np.diff(ids) >= 0).all() and (ids.size == 0 or ids[0] == 1)
        assert (row_s[len(ids):] == 0).all() and (row_t[len(ids):] == 0).all()
        for s in np.unique(ids):
            mask = row_s == s
            np.testing.assert_array_equal(row_p[mask], np.arange(mask.sum()))
            out.append(tuple(row_t[mask]))
        assert (row_p[row_s == 0] == 0).all()
    return out


def _expected_pairs(source, tok, max_length):
    exs = []
    for i in range(len(source)):
        src = tok.encode(sources.as_text(source[i]["en"])) + [tok.eos_id]
        tgt = tok.encode(sources.as_text(source[i]["de"]))
        if len(src) <= max_length and len(tgt) + 1 <= max_length:
            exs.append((tuple(src), (tok.bos_id,) + tuple(tgt), tuple(tgt) + (tok.eos_id,)))
    return exs


def test_seq2seq_packing_preserves_every_example(translate, tok):
    max_length = 24
    ds = pipeline.seq2seq_dataset(translate, tok, batch_size=8, max_length=max_length,
                                  num_epochs=1, drop_remainder=False, seed=3)
    batches = list(ds)
    got = []
    for b in batches:
        assert set(b) == SEQ2SEQ_KEYS
        assert all(v.shape == (8, max_length) and v.dtype == np.int32 for v in b.values())
        np.testing.assert_array_equal(b["weights"], b["targets_segment_ids"] > 0)
        src = _segments(b["inputs"], b["inputs_segment_ids"], b["inputs_positions"])
        tin = _segments(b["targets_in"], b["targets_segment_ids"], b["targets_positions"])
        tgt = _segments(b["targets"], b["targets_segment_ids"], b["targets_positions"])
        got += list(zip(src, tin, tgt))
    expected = _expected_pairs(translate, tok, max_length)
    assert 0.5 * len(translate) < len(expected) < len(translate)  # The filter bites.
    assert sorted(got) == sorted(expected)
    assert all(_spec(b) == _spec(pipeline.seq2seq_batch_spec(8, max_length)) for b in batches)  # the preflight's
    rows_used = sum(int((b["inputs_segment_ids"].max(1) > 0).sum()) for b in batches)
    assert rows_used < len(expected) - 10  # Examples share rows.


def test_unpacked_lm_batches(data_dir, tok):
    docs = sources.load("synthetic_docs", "train", data_dir=data_dir)
    ds = pipeline.lm_dataset(docs, tok, batch_size=4, seq_len=32, pack=False, shuffle=False,
                             num_epochs=1, drop_remainder=False)
    batches = list(ds)
    assert len(batches) == 15 and all(set(b) == LM_KEYS for b in batches)
    first = batches[0]
    ids = tok.encode(sources.as_text(docs[0]["text"]))
    np.testing.assert_array_equal(first["inputs"][0], ([tok.bos_id] + ids)[:32])
    np.testing.assert_array_equal(first["targets"][0], ids[:32])  # Truncated, no EOS.
    np.testing.assert_array_equal(first["positions"][0], np.arange(32))
    assert (first["segment_ids"] <= 1).all()


def _spec(batch):
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()}


def test_packed_lm_shifts_targets_within_segments(translate, tok):
    ds = pipeline.lm_dataset(translate, tok, batch_size=4, seq_len=48, text_key="de", seed=1)
    b = next(iter(ds))
    assert _spec(b) == _spec(pipeline.lm_batch_spec(4, 48))  # what the preflight compiles for
    inp = _segments(b["inputs"], b["segment_ids"], b["positions"])
    tgt = _segments(b["targets"], b["segment_ids"], b["positions"])
    assert max(b["segment_ids"].max(1)) >= 2
    for i, t in zip(inp, tgt):
        assert i[0] == tok.bos_id and t[-1] == tok.eos_id and i[1:] == t[:-1]


def test_same_seed_same_batches_and_state_restore(translate, tok):
    def make(seed):
        return pipeline.seq2seq_dataset(translate, tok, batch_size=4, max_length=32, seed=seed)

    it = iter(make(0))
    first = next(it)
    np.testing.assert_array_equal(first["inputs"], next(iter(make(0)))["inputs"])
    assert not np.array_equal(first["inputs"], next(iter(make(1)))["inputs"])
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # What a checkpoint stores.
    expected = [next(it) for _ in range(3)]
    restored = iter(make(0))
    restored.set_state(state)
    for want in expected:
        got = next(restored)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_records_are_sharded_disjointly_over_hosts():
    shards = [list(pipeline.records(list(range(103)), shuffle=True, seed=5, num_epochs=1,
                                    process_index=h, process_count=3)) for h in range(3)]
    assert sorted(sum(shards, [])) == list(range(103))
    with pytest.raises(ValueError):
        pipeline.records([1], shuffle=False, seed=0, num_epochs=1, process_index=2,
                         process_count=2)


def test_two_hosts_cover_the_global_batch(translate, tok):
    def batches(index, count, batch_size):
        ds = pipeline.lm_dataset(translate, tok, batch_size=batch_size, seq_len=40,
                                 text_key="en", pack=False, seed=2, num_epochs=1,
                                 process_index=index, process_count=count)
        return [b["inputs"] for b in ds]

    single, host0, host1 = batches(0, 1, 8), batches(0, 2, 8), batches(1, 2, 8)
    assert len(single) == len(host0) == len(host1) == 300 // 8
    for g, a, b in zip(single, host0, host1):
        assert a.shape == b.shape == (4, 40)
        rows_a, rows_b = {r.tobytes() for r in a}, {r.tobytes() for r in b}
        assert not rows_a & rows_b
        assert sorted(rows_a | rows_b) == sorted(r.tobytes() for r in g)
    with pytest.raises(ValueError, match="multiple of process_count"):
        pipeline.lm_dataset(translate, tok, batch_size=5, seq_len=8, process_count=2)


@pytest.mark.parametrize("name,kind", [("wmt14", "seq2seq"), ("lm1b", "lm"),
                                       ("wikipedia", "docs"), ("glue/mrpc", "glue")])
def test_mock_data_goes_through_the_same_source_code(name, kind, tok):
    with tfds_mock.mock_data(num_examples=12):
        source = sources.load(name, "train")
        assert len(source) == 12
        if kind == "seq2seq":
            b = next(iter(pipeline.seq2seq_dataset(source, tok, batch_size=2, max_length=64)))
            assert set(b) == SEQ2SEQ_KEYS and b["inputs"].shape == (2, 64)
            assert b["weights"].sum() > 0
        elif kind == "lm":
            b = next(iter(pipeline.lm_dataset(source, tok, batch_size=2, seq_len=64)))
            assert set(b) == LM_KEYS and b["weights"].sum() > 0
        elif kind == "docs":
            docs = sources.documents(source)
            assert len(docs) == 12 and all(isinstance(s, str) for d in docs for s in d)
        else:
            assert {"sentence1", "sentence2", "label"} <= set(source[0])


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        sources.load("wmt15", "train")
    with pytest.raises(ValueError, match="glue needs a task"):
        sources.load("glue", "train")
    with pytest.raises(sources.DatasetNotPreparedError, match=r"synthetic\.prepare_translation\(data_dir\)$"):
        sources.load("synthetic_translate", "train", data_dir=tmp_path)


def _info(root, fields):
    (root / "glue/rte/2.0.0").mkdir(parents=True)
    (root / "glue/rte/2.0.0/dataset_info.json").write_text(json.dumps(fields))


# Each way TFDS says "not prepared" (form -> (make it under root, what TFDS raises)): no directory,
# an empty one, a version folder without dataset_info.json, a dataset_info.json of another dataset,
# and one in array_record without splits (an interrupted preparation: TFDS's KeyError).
UNPREPARED = {
    "missing": (lambda root: None, NotImplementedError),
    "empty": (lambda root: root.mkdir(), NotImplementedError),
    "no_info": (lambda root: (root / "glue/rte/2.0.0").mkdir(parents=True), NotImplementedError),
    "foreign_info": (lambda root: _info(root, {}), AssertionError),
    "no_splits": (lambda root: _info(root, {"name": "glue", "configName": "rte", "version": "2.0.0",
                                            "fileFormat": "array_record"}), KeyError),
}


@pytest.mark.parametrize("form", sorted(UNPREPARED))
def test_every_form_of_not_prepared_is_one_error_saying_how(form, tmp_path):
    root = tmp_path / "tfds"
    make, raised = UNPREPARED[form]
    make(root)
    how = f"`tfds build glue/rte --file_format=array_record --data_dir={root}` (needs the tf extra)"
    with pytest.raises(sources.DatasetNotPreparedError) as e:
        sources.load("glue/rte", "train", data_dir=root)
    assert str(e.value) == (f"dataset glue/rte split 'train' is not prepared as array_record under {root}; "
                            f"prepare it with {how}")
    assert type(e.value.__cause__) is raised
