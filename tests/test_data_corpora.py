"""Synthetic corpora, the local TFDS datasets, and tokenizer round trips."""
import pickle

import pytest
import tensorflow_datasets as tfds

from tfm.data import sources, synthetic, tokenizers

tfds.disable_progress_bar()


@pytest.fixture(scope="module")
def pairs():
    return synthetic.translation_pairs(1500, seed=0)


def test_generators_are_deterministic_and_seeded():
    assert synthetic.translation_pairs(50, seed=3) == synthetic.translation_pairs(50, seed=3)
    assert synthetic.translation_pairs(50, seed=3) != synthetic.translation_pairs(50, seed=4)
    assert synthetic.documents(20, seed=1) == synthetic.documents(20, seed=1)


def test_translation_mapping_reorders(pairs):
    verbs = dict(synthetic.VERBS)
    conj = dict(synthetic.CONJUNCTIONS)
    adverbs = dict(synthetic.ADVERBS)
    n_sub = n_adv = 0
    for en, de in pairs:
        en_w, de_w = en.rstrip(".").lower().split(), de.rstrip(".").lower().split()
        sub = [i for i, w in enumerate(en_w) if w in conj]
        if sub:  # Subordinate clause: the German verb comes last.
            n_sub += 1
            assert de_w[-1] == verbs[next(w for w in en_w[sub[0]:] if w in verbs)]
            assert de_w[de_w.index(conj[en_w[sub[0]]]) - 1].endswith(",")
        if en_w[0] in adverbs:  # Fronted adverb: German verb second (V2).
            n_adv += 1
            assert de_w[0] == adverbs[en_w[0]]
            assert de_w[1] == verbs[next(w for w in en_w if w in verbs)]
    assert n_sub > 300 and n_adv > 200  # ~40% and ~30% of 1500 pairs.


def test_documents_shape():
    docs = synthetic.documents(30, seed=0, min_sentences=2, max_sentences=5)
    assert len(docs) == 30 and all(2 <= len(d) <= 5 for d in docs)
    with pytest.raises(ValueError):
        synthetic.documents(3, min_sentences=4, max_sentences=2)


def test_prepared_tfds_datasets_read_back(tmp_path):
    synthetic.prepare_translation(tmp_path, train=40, validation=5, test=5, seed=7)
    synthetic.prepare_documents(tmp_path, train=10, validation=2, test=2, seed=7)
    train = sources.load("synthetic_translate", "train", data_dir=tmp_path)
    assert len(train) == 40
    got = sorted((sources.as_text(train[i]["en"]), sources.as_text(train[i]["de"]))
                 for i in range(len(train)))
    assert got == sorted(synthetic.translation_pairs(40, seed=7 * 3))
    docs = sources.documents(sources.load("synthetic_docs", "test", data_dir=tmp_path))
    assert sorted(map(tuple, docs)) == sorted(map(tuple, synthetic.documents(2, seed=7 * 3 + 2)))
    with pytest.raises(ValueError, match="already holds"):
        synthetic.prepare_translation(tmp_path, train=41, validation=5, test=5)


def test_write_text(tmp_path):
    path = synthetic.write_text(tmp_path / "a" / "x.txt", ["Grüße.", "b"])
    assert open(path, encoding="utf-8").read() == "Grüße.\nb\n"
    with pytest.raises(ValueError):
        synthetic.write_text(tmp_path / "y.txt", ["a\nb"])


def test_sentencepiece_round_trip(pairs, tmp_path):
    texts = [t for p in pairs for t in p]
    tok = tokenizers.train_sentencepiece(texts, 300, path=tmp_path / "sp.model")
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (300, 0, 1, 2, 3)
    assert all(tok.decode(tok.encode(t)) == t for t in texts)
    assert tok.unk_id not in {i for t in texts for i in tok.encode(t)}
    ids = tok.encode(texts[1])
    assert tok.decode(ids + [tok.eos_id] + ids + [0, 0]) == texts[1]  # Stops at EOS.
    loaded = tokenizers.SentencePieceTokenizer.load(tmp_path / "sp.model")
    assert loaded.encode(texts[5]) == pickle.loads(pickle.dumps(tok)).encode(texts[5])
    assert sum(map(len, map(tok.encode, texts))) < 0.5 * sum(map(len, texts))  # Real merges.


def test_wordpiece_round_trip(tmp_path):
    sentences = [s for d in synthetic.documents(200, seed=0) for s in d]
    tok = tokenizers.train_wordpiece(sentences, 200, path=tmp_path / "vocab.txt")
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    assert all(tok.decode(tok.encode(s)) == s.lower() for s in sentences)
    ids = tok.encode(sentences[0])
    assert tok.decode([tok.cls_id] + ids + [tok.sep_id, 0, 0]) == sentences[0].lower()
    loaded = tokenizers.WordPieceTokenizer.load(tmp_path / "vocab.txt")
    assert loaded.encode(sentences[3]) == pickle.loads(pickle.dumps(tok)).encode(sentences[3])
    with pytest.raises(ValueError, match="special tokens"):
        tokenizers.WordPieceTokenizer({"[PAD]": 0, "a": 1})
    with pytest.raises(FileNotFoundError):
        tokenizers.WordPieceTokenizer.load(tmp_path / "missing.txt")
