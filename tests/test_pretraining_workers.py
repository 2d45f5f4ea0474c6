"""BERT / RoBERTa pretraining streams with their next windows built by worker processes
(`PretrainingStream(workers=n)`, the recipes' `data_workers`): the in-process batches and stream
positions, bit for bit, across windows and an epoch; resumable from any position."""
import json

import numpy as np
import pytest

from experiments import common
from experiments.bert import pretrain
from experiments.bert.configs import base
from experiments.bert.settings import BertSettings
from tfm.data import documents, sources, streaming, synthetic, tokenizers


@pytest.fixture(scope="module")
def tok():
    docs = synthetic.topical_documents(200, seed=2)
    return tokenizers.train_wordpiece((s for d in docs for s in d), 150)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A generated TFDS dataset (array_record) and a text directory as one chunked corpus."""
    data_dir = tmp_path_factory.mktemp("tfds")
    synthetic.prepare_topical_documents(data_dir, train=80, validation=1, test=1, seed=4)
    source = sources.load("synthetic_topics", "train", data_dir=data_dir)
    books = synthetic.write_text_corpus(tmp_path_factory.mktemp("text"), 20_000, file_bytes=8_000, seed=5)
    return documents.Corpus([documents.TfdsDocuments(source, 20), documents.TextDocuments([books], 6_000)])


def stream(corpus, tok, **kw):
    args = dict(batch_size=8, max_seq_length=48, max_predictions_per_seq=6, shuffle_chunks=2, seed=3)
    return streaming.PretrainingStream(corpus, tok, **{**args, **kw})


def assert_same(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("next_sentence", [True, False])
def test_workers_give_the_in_process_batches_and_positions(corpus, tok, next_sentence):
    """2 workers: the in-process stream's batches and state after each, through an epoch
    boundary; a fresh 2-worker stream set to an in-process mid-stream state (JSON round trip)
    continues it; a finite stream drops the same remainder."""
    alone, workers = stream(corpus, tok, next_sentence=next_sentence), stream(corpus, tok, next_sentence=next_sentence, workers=2)
    per_epoch = sum(len(alone.chunk_instances(int(c))) for c in alone.host_chunks(0)) // 8
    assert alone.window_count(0) >= 3 and per_epoch > 10
    want, states = [], []
    for _ in range(per_epoch + 3):
        want.append(next(alone))
        states.append(alone.get_state())
    for batch, state in zip(want, states):
        assert_same(next(workers), batch)
        assert workers.get_state() == state
    assert states[-1]["epoch"] == 1
    workers.close()
    stop = per_epoch // 2
    resumed = stream(corpus, tok, next_sentence=next_sentence, workers=2)
    resumed.set_state(json.loads(json.dumps(states[stop - 1])))
    for batch in want[stop:stop + 8]:
        assert_same(next(resumed), batch)
    resumed.close()
    finite = [stream(corpus, tok, next_sentence=next_sentence, num_epochs=1, workers=w) for w in (0, 1)]
    counts = [sum(1 for _ in s) for s in finite]
    assert counts[0] == counts[1] == per_epoch and finite[0].get_state() == finite[1].get_state()
    finite[1].close()


def test_data_workers_reaches_the_pretraining_stream(corpus, tok):
    """The recipe's data_workers is the stream's worker count; a negative or unset value fails
    naming the key; the stream refuses a negative count itself."""
    c = base.get_config("runlocal")
    c.data_workers = 3
    s = common.settings_of(c, BertSettings)
    phase = pretrain.phases(s, 8)[0]
    assert pretrain.train_stream(s, phase, corpus, tok, frozenset(), seed=0).workers == 3
    for bad in (-1, None):
        c.data_workers = bad
        with pytest.raises(ValueError, match=rf"^data_workers={bad}: the training stream's worker processes"):
            common.settings_of(c, BertSettings)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        stream(corpus, tok, workers=-1)
