"""Streamed pretraining data: chunked corpora read lazily (TFDS and text directories), the
held-out carve and vocabulary sample, resumption bit for bit, disjoint host shards that cover
the corpus once per epoch, and flat host memory as the corpus grows tenfold."""
import collections
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

import tfds_mock
from tfm.data import documents, sources, streaming, synthetic, tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference_text_documents(directory):
    """The documents of a text directory, read whole (the definition TextDocuments streams)."""
    docs = []
    for root, _, names in sorted(os.walk(directory)):
        for path in sorted(os.path.join(root, n) for n in names):
            with open(path, encoding="utf-8") as f:
                docs += [sources.split_sentences(block) for block in re.split(r"\n\s*\n", f.read())]
    return [d for d in docs if d]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """Files with documents of 1-6 lines separated by 1-3 blank lines (some holding spaces), a
    leading blank line, a file without a final newline, a one-document file, a long line,
    non-ASCII text."""
    root = tmp_path_factory.mktemp("books")
    rng = random.Random(0)
    sentences = [s for d in synthetic.topical_documents(60, seed=1) for s in d]
    for f in range(5):
        blocks = ["\n".join(rng.sample(sentences, rng.randint(1, 6))) for _ in range(1 if f == 3 else rng.randint(5, 30))]
        text = "".join(b + rng.choice(["\n\n", "\n  \n", "\n\n\n", "\n \t\n\n"]) for b in blocks)
        if f == 0:
            text = "Grüße, à bientôt.\nÇa va.\n\n" + text  # multi-byte characters by chunk edges
        if f == 1:
            text = "\n" + text + " ".join(sentences[:200])
        if f == 2:
            text = text.rstrip("\n")
        (root / ("sub" if f == 4 else "") / f"book{f}.txt").parent.mkdir(exist_ok=True)
        (root / ("sub" if f == 4 else "") / f"book{f}.txt").write_text(text, encoding="utf-8")
    return root


@pytest.mark.parametrize("chunk_bytes", [1, 37, 500, 1 << 20])
def test_text_chunks_hold_each_document_once(text_dir, chunk_bytes):
    """Whatever the chunk size (one byte up to the whole corpus), the chunks' documents in order
    are the whole-file reading's, each once, and keys do not depend on the chunk size."""
    corpus = documents.TextDocuments([text_dir], chunk_bytes)
    got = [kd for c in range(len(corpus)) for kd in corpus.chunk(c)]
    assert [d for _, d in got] == _reference_text_documents(text_dir)
    whole = documents.TextDocuments([text_dir], 1 << 30)
    assert [k for k, _ in got] == [k for k, _ in whole.chunk(0)]
    assert len({k for k, _ in got}) == len(got) > 60


@pytest.fixture(scope="module")
def tok():
    docs = synthetic.topical_documents(200, seed=2)
    return tokenizers.train_wordpiece((s for d in docs for s in d), 150)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A generated TFDS dataset (real array_record files) and a text directory as one corpus."""
    data_dir = tmp_path_factory.mktemp("tfds")
    synthetic.prepare_topical_documents(data_dir, train=120, validation=1, test=1, seed=4)
    source = sources.load("synthetic_topics", "train", data_dir=data_dir)
    books = synthetic.write_text_corpus(tmp_path_factory.mktemp("text"), 30_000, file_bytes=8_000, seed=5)
    return documents.Corpus([documents.TfdsDocuments(source, 20),
                             documents.TextDocuments([books], 6_000)])


def _stream(corpus, tok, **kw):
    args = dict(batch_size=8, max_seq_length=48, max_predictions_per_seq=6, shuffle_chunks=2, seed=3)
    return streaming.PretrainingStream(corpus, tok, **{**args, **kw})


@pytest.mark.parametrize("next_sentence", [True, False])
def test_resume_gives_the_same_batches_bit_for_bit(corpus, tok, next_sentence):
    """N batches, save the state (through JSON, as checkpoints do), a fresh iterator from it:
    the next batches equal the uninterrupted run's, across windows and an epoch boundary."""
    run = _stream(corpus, tok, next_sentence=next_sentence)
    per_epoch = sum(len(run.chunk_instances(int(c))) for c in run.host_chunks(0)) // 8
    stops = (3, per_epoch - 1)
    total = per_epoch + 4
    uninterrupted = [next(run) for _ in range(total)]
    assert run.get_state()["epoch"] == 1
    for stop in stops:
        first = _stream(corpus, tok, next_sentence=next_sentence)
        for _ in range(stop):
            next(first)
        resumed = _stream(corpus, tok, next_sentence=next_sentence)
        resumed.set_state(json.loads(json.dumps(first.get_state())))
        for want in uninterrupted[stop:]:
            got = next(resumed)
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    with pytest.raises(ValueError, match="not a stream position"):
        run.set_state({"next_index": 5})  # a Grain iterator's state
    (origin, instance), = [next(run.instances())]  # one instance, masked in epochs 0 and 1:
    again = run.example((0, *origin[1:]), instance), run.example((1, *origin[1:]), instance)
    assert not np.array_equal(again[0]["mlm_positions"], again[1]["mlm_positions"])  # new masks


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_read_disjoint_chunks_covering_the_corpus(corpus, tok, hosts):
    """Per epoch the hosts' chunks partition the corpus, so every document is read by one host
    once; their instances (origin -> tokens) are exactly a single host's, none twice, and every
    host's batches are full of them."""
    single = _stream(corpus, tok, num_epochs=1)
    everything = dict(single.instances())
    for epoch in (0, 1):
        chunks = [c for h in range(hosts) for c in _stream(corpus, tok, process_index=h,
                                                             process_count=hosts).host_chunks(epoch)]
        assert sorted(chunks) == list(range(len(corpus)))
    seen = collections.Counter()
    union = {}
    for h in range(hosts):
        stream = _stream(corpus, tok, num_epochs=1, process_index=h, process_count=hosts, batch_size=8 * hosts)
        mine = dict(stream.instances())
        seen.update(mine.keys())
        union.update(mine)
        stream.set_state({"epoch": 0, "window": 0, "index": 0})
        assert len(list(stream)) == len(mine) // 8
    assert max(seen.values()) == 1 and union == everything
    keys = [k for c in range(len(corpus)) for k, _ in corpus.chunk(c)]
    assert len(keys) == len(set(keys)) == 148  # 120 dataset documents, 28 in the text files


def test_held_out_and_vocabulary_sample(corpus, tok):
    """hold_out: `count` documents, the same on every call, whose instances never reach the
    training stream; sample: a bounded deterministic sample without them."""
    keys, held = documents.hold_out(corpus, 12, seed=1)
    assert len(keys) == len(held) == 12 and (keys, held) == documents.hold_out(corpus, 12, seed=1)
    held_sentences = {s for d in held for s in d}
    stream = _stream(corpus, tok, exclude=keys, num_epochs=1)
    origins = {o[1] for o, _ in stream.instances()}
    train = [d for c in sorted(origins) for k, d in corpus.chunk(c) if k not in keys]
    assert not {tuple(d) for d in held} & {tuple(d) for d in train}
    docs = list(documents.sample(corpus, 30, exclude=keys))
    assert len(docs) == 30 and docs == list(documents.sample(corpus, 30, exclude=keys))
    assert not any(tuple(d) in {tuple(h) for h in held} for d in docs)
    assert held_sentences  # the carve took real documents
    with pytest.raises(ValueError, match="eval_documents=400"):
        documents.hold_out(corpus, 400)


def test_wikipedia_mock_data_streams(tok):
    """The real wikipedia builder's source (mock data) through TfdsDocuments and the stream."""
    with tfds_mock.mock_data(num_examples=30):
        source = sources.load("wikipedia", "train")
        corpus = documents.Corpus([documents.TfdsDocuments(source, 10)])
        assert [k for c in range(3) for (_, k), _ in corpus.chunk(c)] == list(range(30))
        batch = next(_stream(corpus, tok, batch_size=4))
    assert batch["input_ids"].shape == (4, 48) and (batch["input_ids"][:, 0] == tok.cls_id).all()


def _first_batch(directory):
    out = subprocess.run([sys.executable, "-m", "benchmarks.input_pipeline", "--first-batch", str(directory)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_host_memory_is_flat_in_corpus_size(tmp_path):
    """The pipeline to its first batch over a generated 5 MB and 50 MB text corpus (a fresh
    process each): peak RSS within 20%, time to the first batch not growing (generous slack for
    shared cores; the in-memory path took 2.4x longer at 4x the corpus, benchmarks/RESULTS.md)."""
    small = _first_batch(synthetic.write_text_corpus(tmp_path / "small", 5 << 20, seed=0))
    large = _first_batch(synthetic.write_text_corpus(tmp_path / "large", 50 << 20, seed=1))
    assert large["corpus_bytes"] >= 9 * small["corpus_bytes"]
    assert large["peak_rss_bytes"] < 1.2 * small["peak_rss_bytes"], (small, large)
    assert large["seconds_to_first_batch"] < 3 * small["seconds_to_first_batch"] + 5, (small, large)
