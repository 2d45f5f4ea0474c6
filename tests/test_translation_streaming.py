"""The translation recipe's startup at corpus scale: what it reads before step 1 is bounded by its
config (the tokenizer's sample, the token budget's packed sample), not by the corpus size, and
the training stream is split over hosts disjointly and completely."""
from collections import Counter

import grain
import numpy as np
import pytest

from experiments import common
from experiments.translation import train
from experiments.translation.configs import base
from experiments.translation.settings import TranslationSettings
from tfm.data import pipeline, sources, synthetic, tokenizers


class CountingPairs:
    """A generated parallel corpus of `n` pairs, pair i made on access from seed i (no corpus in
    memory), with the TFDS source's interface (`__getitems__` too); `reads` counts the pairs read."""

    def __init__(self, n: int):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        en, de = synthetic.translation_pairs(1, seed=int(i))[0]
        return {"en": en.encode(), "de": de.encode()}

    def __getitems__(self, keys):
        return [self[i] for i in keys]


def _config(spm_sentences: int = 2000):
    c = base.get_config("runlocal")
    c.spm_sentences = spm_sentences
    return c


def test_startup_reads_a_bounded_number_of_pairs_whatever_the_corpus_size(tmp_path):
    """The recipe's own preparation (`train_stream`: tokenizer, token budget, the stream) to its
    first batch reads as many pairs from 200k as from 20k (within 25%, each under a quarter of the
    small corpus); the tokenizer's share is exactly spm_sentences / 2. Training the tokenizer on
    the whole split, as before, read every pair."""
    reads = {}
    for n in (20_000, 200_000):
        corpus = CountingPairs(n)
        tok = train.tokenizer(common.settings_of(_config(), TranslationSettings), str(tmp_path / f"{n}"), corpus)
        assert corpus.reads == 1000, n
        _, exp, data = train.train_stream(_config(), str(tmp_path / f"{n}"), corpus)  # the saved tokenizer
        batch = next(iter(data))
        assert batch["inputs"].shape == (exp.train.batch_size, 40) and batch["weights"].sum() > 0
        reads[n] = corpus.reads
    small, big = reads[20_000], reads[200_000]
    assert small < 20_000 // 4 and abs(big / small - 1) < 0.25, reads


def test_tokenizer_sample_is_deterministic_and_sized_by_spm_sentences(tmp_path, monkeypatch):
    """spm_sentences reaches SentencePiece: exactly that many sentences (both sides of
    ceil(k / 2) pairs; an odd k drops the last German side), the same sample and model in two
    workdirs (two hosts), a different model for another k; 0 fails naming the key."""
    fed, real = [], tokenizers.train_sentencepiece

    def counting(texts, vocab_size, **kwargs):
        texts = list(texts)
        fed.append(texts)
        return real(texts, vocab_size, **kwargs)

    monkeypatch.setattr(tokenizers, "train_sentencepiece", counting)
    corpus = CountingPairs(50_000)
    models = {}
    for k, host in ((1201, "a"), (1201, "b"), (3000, "a")):
        s = common.settings_of(_config(k), TranslationSettings)
        corpus.reads = 0
        models[k, host] = train.tokenizer(s, str(tmp_path / f"{k}{host}"), corpus)
        assert corpus.reads == -(-k // 2) and len(fed[-1]) == k
    assert fed[0] == fed[1] and fed[0] != fed[2][:1201]
    sentence = "The big dog sees the quiet cat because the king reads the letter."
    assert models[1201, "a"].encode(sentence) == models[1201, "b"].encode(sentence)
    assert models[1201, "a"]._proto == models[1201, "b"]._proto != models[3000, "a"]._proto
    chosen = [ex["en"] for ex in sources.sample(corpus, 601, seed=0)]
    assert chosen == [ex["en"] for ex in sources.sample(corpus, 601, seed=0)] and len(set(chosen)) > 590
    with pytest.raises(ValueError, match="spm_sentences=0"):
        train.tokenizer(common.settings_of(_config(0), TranslationSettings), str(tmp_path / "z"), corpus)


@pytest.mark.parametrize("hosts", [2, 4])
def test_packed_translation_stream_covers_the_corpus_once_over_hosts(hosts):
    """One epoch of the packed seq2seq stream on `hosts` hosts: every pair that fits appears in
    exactly one host's rows, once (its source segment), and no other pair does."""
    corpus = [{"en": en, "de": de} for en, de in synthetic.translation_pairs(240, seed=1)]
    tok = tokenizers.train_sentencepiece((t for p in synthetic.translation_pairs(500, 0) for t in p), 200)
    want = Counter(tuple(tok.encode(p["en"]) + [tok.eos_id]) for p in corpus
                   if max(len(tok.encode(p["en"])), len(tok.encode(p["de"]))) + 1 <= 24)
    seen = Counter()
    for h in range(hosts):
        for b in pipeline.seq2seq_dataset(corpus, tok, batch_size=4 * hosts, max_length=24, num_epochs=1,
                                          drop_remainder=False, process_index=h, process_count=hosts):
            for ids, seg in zip(b["inputs"], b["inputs_segment_ids"]):
                seen.update(tuple(int(i) for i in ids[seg == k]) for k in range(1, seg.max() + 1))
    assert seen == want and 100 < sum(want.values()) < len(corpus)  # some are too long: dropped
    assert np.all([len(k) > 1 for k in want])


def test_read_options_change_no_batch_and_no_state():
    """The pipeline's read threads and buffer (pipeline.READ_OPTIONS) give Grain's defaults'
    batches, in order, and the same iterator state after them."""
    corpus = [{"en": en, "de": de} for en, de in synthetic.translation_pairs(300, seed=2)]
    tok = tokenizers.train_sentencepiece((t for p in synthetic.translation_pairs(500, 0) for t in p), 200)
    runs = []
    for options in (pipeline.READ_OPTIONS, grain.ReadOptions(), grain.ReadOptions(num_threads=0)):
        it = iter(pipeline.seq2seq_dataset(corpus, tok, batch_size=8, max_length=32, seed=4, read_options=options))
        runs.append(([next(it) for _ in range(12)], it.get_state()))
    for batches, state in runs[1:]:
        assert state == runs[0][1]
        for got, want in zip(batches, runs[0][0]):
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
