"""BERT MLM+NSP example creation: structure, masking statistics, NSP rate, determinism."""
import numpy as np
import pytest

from tfm.data import pretraining, synthetic, tokenizers

KEYS = {"input_ids", "token_type_ids", "attention_mask", "mlm_positions", "mlm_ids",
        "mlm_weights", "nsp_label"}


@pytest.fixture(scope="module")
def docs():
    return synthetic.documents(150, seed=0, min_sentences=4, max_sentences=10)


@pytest.fixture(scope="module")
def tok(docs):
    return tokenizers.train_wordpiece([s for d in docs for s in d], 300)


def _batches(docs, tok, n, **kw):
    ds = pretraining.pretraining_dataset(docs, tok, batch_size=16, max_seq_length=64,
                                         max_predictions_per_seq=12, num_epochs=1,
                                         drop_remainder=False, **kw)
    return [b for _, b in zip(range(n), ds)]


def test_batch_structure(docs, tok):
    batches = _batches(docs, tok, 10, seed=0)
    spec = {k: (s.shape, s.dtype) for k, s in pretraining.pretraining_batch_spec(16, 64, 12).items()}
    for b in batches:
        assert set(b) == KEYS and all(v.dtype == np.int32 for v in b.values())
        assert {k: (v.shape, v.dtype) for k, v in b.items()} == spec  # what the preflight compiles for
        assert b["input_ids"].shape == b["token_type_ids"].shape == (16, 64)
        assert b["mlm_positions"].shape == b["mlm_weights"].shape == (16, 12)
        assert b["nsp_label"].shape == (16,)
        for row in range(16):
            ids, types, mask = b["input_ids"][row], b["token_type_ids"][row], b["attention_mask"][row]
            n = mask.sum()
            assert mask[:n].all() and not mask[n:].any() and not ids[n:].any()
            assert ids[0] == tok.cls_id and ids[n - 1] == tok.sep_id
            seps = np.flatnonzero(ids == tok.sep_id)
            assert len(seps) == 2  # [CLS] A [SEP] B [SEP]
            assert not types[:seps[0] + 1].any() and types[seps[0] + 1:n].all()
            assert not types[n:].any()
            w = b["mlm_weights"][row]
            k = w.sum()
            assert k == min(12, round(n * 0.15)) and w[:k].all() and not w[k:].any()
            pos = b["mlm_positions"][row][:k]
            assert (np.diff(pos) > 0).all() and (pos > 0).all() and (pos < n).all()
            assert not np.isin(b["mlm_ids"][row][:k], list(tok.special_ids)).any()
    again = _batches(docs, tok, 10, seed=0)
    for a, b in zip(batches, again):
        for key in KEYS:
            np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(batches[0]["input_ids"], _batches(docs, tok, 1, seed=1)[0]["input_ids"])


def test_statistics_over_10k_examples():
    """Over >= 10k pipeline examples: 15% +- 0.5 pt of the tokens are predicted, of those 80%,
    10%, 10% +- 1 pt become [MASK], a random token, stay; NSP labels are 50% +- 2 pt.

    ~100k predictions: the binomial std of a share is <= 0.13 pt. A random replacement equal
    to the original (1 in ~300) counts as unchanged. The documents are long (150-200
    sentences): BERT's rule that a one-sentence chunk always takes a random B (kept here, as
    the original) adds ~0.5/chunks-per-document to the NSP rate, ~10 pt on short documents.
    """
    docs = synthetic.topical_documents(100, seed=5, min_sentences=150, max_sentences=200)
    tok = tokenizers.train_wordpiece([s for d in docs[:10] for s in d], 300)
    ds = pretraining.pretraining_dataset(docs, tok, batch_size=500, max_seq_length=80,
                                         max_predictions_per_seq=20, short_seq_prob=0.0, dupe_factor=4,
                                         num_epochs=1, drop_remainder=False)
    tokens = predicted = 0
    counts = {"mask": 0, "random": 0, "keep": 0}
    labels = []
    for b in ds:
        real = b["attention_mask"][:, 0] == 1  # the last batch is padded with empty rows
        w = b["mlm_weights"][real] == 1
        shown = np.take_along_axis(b["input_ids"][real], b["mlm_positions"][real], axis=1)[w]
        target = b["mlm_ids"][real][w]
        tokens += int(b["attention_mask"][real].sum())
        predicted += int(w.sum())
        counts["mask"] += int((shown == tok.mask_id).sum())
        counts["keep"] += int((shown == target).sum())
        counts["random"] += int(((shown != tok.mask_id) & (shown != target)).sum())
        labels.extend(b["nsp_label"][real].tolist())
    assert len(labels) >= 10_000
    assert abs(predicted / tokens - 0.15) < 0.005
    assert abs(counts["mask"] / predicted - 0.8) < 0.01
    assert abs(counts["random"] / predicted - 0.1) < 0.01
    assert abs(counts["keep"] / predicted - 0.1) < 0.01
    assert abs(np.mean(labels) - 0.5) < 0.02


def test_max_predictions_caps():
    tokens = np.arange(5, 205)
    _, pos, _ = pretraining.mask_tokens(
        tokens, np.random.default_rng(0), mask_id=4, special_ids=[0, 1, 2, 3, 4],
        replacement_ids=np.arange(5, 300), masked_lm_prob=0.15, max_predictions=20)
    assert len(pos) == 20


def test_nsp_pairs():
    """Not-random B continues A in the same document; random B comes from another one.

    BERT's algorithm flips a fair coin for chunks of 2+ sentences and always takes a random
    B for a one-sentence chunk, so on long documents the random share is a little over 50%;
    over ~1,100 pairs its std is 1.5%.
    """
    docs = [[[1000 * d + 10 * s + t for t in range(int(3 + (d + s) % 5))] for s in range(40)]
            for d in range(200)]
    instances = pretraining.create_instances(docs, max_seq_length=64, short_seq_prob=0.1, seed=0)
    labels = np.array([label for _, _, label in instances])
    assert len(instances) > 1000
    assert 0.48 < labels.mean() < 0.58
    for a, b, label in instances:
        assert 2 <= len(a) + len(b) <= 61
        same_doc = a[-1] // 1000 == b[0] // 1000
        if label == 0:
            assert same_doc and b[0] > a[-1]
        else:
            assert not same_doc
    assert instances == pretraining.create_instances(docs, max_seq_length=64, seed=0)
    with pytest.raises(ValueError, match="at least 2"):
        pretraining.create_instances(docs[:1], max_seq_length=64)
