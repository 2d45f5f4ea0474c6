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
    for b in batches:
        assert set(b) == KEYS and all(v.dtype == np.int32 for v in b.values())
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


def test_masking_statistics():
    """15% of tokens predicted; of those 80% [MASK], 10% random, 10% unchanged.

    About 5,900 predictions: the binomial std of the 80% share is 0.5%, tolerances are 3%
    (80%) and 2% (10% shares). A random replacement equal to the original (1 in 995) counts
    as unchanged.
    """
    rng = np.random.default_rng(0)
    special = [0, 1, 2, 3, 4]
    replacement_ids = np.arange(5, 1000)
    masked_total = predicted = tokens_total = 0
    counts = {"mask": 0, "random": 0, "keep": 0}
    for _ in range(400):
        body = rng.integers(5, 1000, size=int(rng.integers(80, 120)))
        tokens = np.concatenate([[2], body, [3]])
        masked, pos, labels = pretraining.mask_tokens(
            tokens, rng, mask_id=4, special_ids=special, replacement_ids=replacement_ids,
            masked_lm_prob=0.15, max_predictions=40)
        np.testing.assert_array_equal(labels, tokens[pos])
        untouched = np.setdiff1d(np.arange(len(tokens)), pos)
        np.testing.assert_array_equal(masked[untouched], tokens[untouched])
        tokens_total += len(tokens)
        predicted += len(pos)
        counts["mask"] += int((masked[pos] == 4).sum())
        counts["keep"] += int((masked[pos] == labels).sum())
        counts["random"] += int(((masked[pos] != 4) & (masked[pos] != labels)).sum())
        masked_total += len(pos)
    assert abs(predicted / tokens_total - 0.15) < 0.005  # round(L * 0.15) per sequence.
    assert abs(counts["mask"] / masked_total - 0.8) < 0.03
    assert abs(counts["random"] / masked_total - 0.1) < 0.02
    assert abs(counts["keep"] / masked_total - 0.1) < 0.02


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
