"""BERT pretraining examples (MLM + NSP) as in Devlin et al. 2018 (create_pretraining_data.py).

`create_instances` builds sentence pairs from documents: segment A is a prefix of a chunk of
consecutive sentences, segment B its continuation or, with probability 1/2 (always for a
one-sentence chunk), sentences of a random other document; with `short_seq_prob` a shorter
target length; the pair is truncated to max_seq_length - 3 by trimming the longer side at a
random end. `mask_tokens` then predicts 15% of the tokens (at most max_predictions_per_seq,
never [CLS]/[SEP]): 80% become [MASK], 10% a random non-special token, 10% stay. With
whole-word masking the words (a token and its following continuation pieces, `##` in
WordPiece) are drawn as units and all pieces of a drawn word are predicted; as in the
original, the 80/10/10 choice is still made per piece, and a word that would exceed the
prediction budget is skipped.

`create_full_sentence_instances` is RoBERTa's FULL-SENTENCES input (Liu et al. 2019): sentences
packed contiguously up to max_seq_length - 2 tokens, crossing document boundaries with a
[SEP] between documents; such rows are [CLS] tokens [SEP] with token type 0 and no NSP label.

`pretraining_dataset` yields fixed-shape int32 batches (b = per-host batch, L =
max_seq_length, P = max_predictions_per_seq):

    input_ids, token_type_ids, attention_mask      [b, L]   ([CLS] A [SEP] B [SEP] + padding)
    mlm_positions, mlm_ids, mlm_weights            [b, P]   (weights 0 on unused slots)
    nsp_label                                      [b]      (0 = B follows A, 1 = random B;
                                                             absent when next_sentence=False)

`pretraining_dataset` holds its documents in memory (small corpora, held-out sets);
`tfm.data.streaming` makes the same batches from a corpus of any size, a chunk at a time.

Pairs are created once from `seed`; masks are drawn per (epoch, example) from `seed`, so
every epoch sees new masks (RoBERTa-style dynamic masking in place of BERT's dupe_factor
static copies, which `dupe_factor` still provides).
"""
from __future__ import annotations

import functools
import random
from typing import Sequence

import grain
import jax
import numpy as np

from tfm.data.pipeline import fixed_batches, host_batch_size, records
from tfm.data.tokenizers import WordPieceTokenizer

Instance = tuple[list[int], list[int], int]  # (tokens_a, tokens_b, nsp_label)


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]


def _document_instances(docs: Sequence[Sequence[list[int]]], index: int, max_seq_length: int,
                        short_seq_prob: float, rng: random.Random) -> list[Instance]:
    doc, max_tokens = docs[index], max_seq_length - 3
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    instances, chunk, length, i = [], [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for s in chunk[:a_end] for t in s]
            if len(chunk) == 1 or rng.random() < 0.5:
                label, b = 1, []
                other = index
                for _ in range(10):
                    other = rng.randint(0, len(docs) - 1)
                    if other != index:
                        break
                other_doc = docs[other]
                for sentence in other_doc[rng.randint(0, len(other_doc) - 1):]:
                    b.extend(sentence)
                    if len(b) >= target - len(a):
                        break
                i -= len(chunk) - a_end  # The unused sentences start the next chunk.
            else:
                label, b = 0, [t for s in chunk[a_end:] for t in s]
            _truncate_pair(a, b, max_tokens, rng)
            if a and b:
                instances.append((a, b, label))
            chunk, length = [], 0
        i += 1
    return instances


def create_instances(documents: Sequence[Sequence[Sequence[int]]], *, max_seq_length: int,
                     short_seq_prob: float = 0.1, dupe_factor: int = 1,
                     seed: int = 0) -> list[Instance]:
    """Sentence pairs (tokens_a, tokens_b, nsp_label) from tokenized documents (lists of
    sentences of token ids), shuffled; deterministic given `seed`."""
    docs = [[list(s) for s in d if len(s)] for d in documents]
    docs = [d for d in docs if d]
    if len(docs) < 2:
        raise ValueError(f"need at least 2 non-empty documents for NSP, got {len(docs)}")
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must be >= 5, got {max_seq_length}")
    rng = random.Random(seed)
    instances = [inst for _ in range(dupe_factor) for index in range(len(docs))
                 for inst in _document_instances(docs, index, max_seq_length, short_seq_prob, rng)]
    rng.shuffle(instances)
    return instances


def create_full_sentence_instances(documents: Sequence[Sequence[Sequence[int]]], *,
                                   max_seq_length: int, separator_id: int,
                                   seed: int = 0) -> list[Instance]:
    """RoBERTa FULL-SENTENCES rows (tokens, [], -1): the documents' sentences in order, packed
    up to max_seq_length - 2 tokens, `separator_id` between documents; a sentence longer than
    a row is cut across rows. Rows are shuffled (deterministic given `seed`)."""
    if max_seq_length < 3:
        raise ValueError(f"max_seq_length must be >= 3, got {max_seq_length}")
    room, rows, row = max_seq_length - 2, [], []
    for d, doc in enumerate(documents):
        pieces = [list(s) for s in doc if len(s)]
        if row and pieces and d:
            pieces[0] = [separator_id] + pieces[0]
        for sentence in pieces:
            if row and len(row) + len(sentence) > room:
                rows.append(row)
                row = []
            while len(sentence) > room:
                rows.append(sentence[:room])
                sentence = sentence[room:]
            row = row + sentence
    if row:
        rows.append(row)
    rows = [r[1:] if r[0] == separator_id else r for r in rows]
    rows = [r for r in rows if r]
    if not rows:
        raise ValueError("the documents hold no tokens")
    random.Random(seed).shuffle(rows)
    return [(r, [], -1) for r in rows]


def _words(candidates: np.ndarray, continues_word: np.ndarray) -> list[np.ndarray]:
    """Candidate positions grouped into words: a position starts a new word unless it
    continues the previous candidate position's word (`continues_word` [L])."""
    if not len(candidates):
        return []
    joins = continues_word[candidates[1:]] & (np.diff(candidates) == 1)
    return np.split(candidates, np.flatnonzero(~joins) + 1)


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, *, mask_id: int,
                special_ids: Sequence[int], replacement_ids: np.ndarray,
                masked_lm_prob: float, max_predictions: int,
                continues_word: np.ndarray | None = None):
    """BERT masking of one sequence [L] -> (masked tokens [L], sorted positions [n], labels [n]).

    n <= min(max_predictions, max(1, round(L * masked_lm_prob))) over the non-special tokens
    (equal without whole-word masking). `continues_word` [L] (bool, True on WordPiece `##`
    pieces) turns on whole-word masking: words are drawn whole, a word that would exceed n is
    skipped; the 80/10/10 replacement is drawn per piece, as in the original.
    """
    candidates = np.flatnonzero(~np.isin(tokens, special_ids))
    n = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))), len(candidates))
    if continues_word is None:
        positions = np.sort(rng.permutation(candidates)[:n])
    else:
        words = _words(candidates, continues_word)
        chosen, count = [], 0
        for w in rng.permutation(len(words)):
            if count >= n:
                break
            if count + len(words[w]) <= n:
                chosen.append(words[w])
                count += len(words[w])
        positions = np.sort(np.concatenate(chosen)) if chosen else np.zeros((0,), np.int64)
    labels = tokens[positions]
    draw = rng.random(len(positions))
    masked = tokens.copy()
    masked[positions] = np.where(draw < 0.8, mask_id, np.where(
        draw < 0.9, labels, rng.choice(replacement_ids, size=len(positions))))
    return masked, positions, labels


def _features(instance: Instance, rng: np.random.Generator, *, tokenizer: WordPieceTokenizer,
              replacement_ids: np.ndarray, continuation_ids: np.ndarray | None,
              max_seq_length: int, max_predictions: int,
              masked_lm_prob: float) -> dict[str, np.ndarray]:
    a, b, label = instance
    tok = tokenizer
    second = b + [tok.sep_id] if b else []
    tokens = np.asarray([tok.cls_id] + a + [tok.sep_id] + second, np.int32)
    masked, positions, labels = mask_tokens(
        tokens, rng, mask_id=tok.mask_id, special_ids=sorted(tok.special_ids),
        replacement_ids=replacement_ids, masked_lm_prob=masked_lm_prob,
        max_predictions=max_predictions,
        continues_word=None if continuation_ids is None else np.isin(tokens, continuation_ids))
    length, n = len(tokens), len(positions)
    out = {k: np.zeros((max_seq_length,), np.int32)
           for k in ("input_ids", "token_type_ids", "attention_mask")}
    out.update({k: np.zeros((max_predictions,), np.int32) for k in ("mlm_positions", "mlm_ids", "mlm_weights")})
    out["input_ids"][:length] = masked
    out["token_type_ids"][len(a) + 2:length] = 1
    out["attention_mask"][:length] = 1
    out["mlm_positions"][:n], out["mlm_ids"][:n], out["mlm_weights"][:n] = positions, labels, 1
    if label >= 0:
        out["nsp_label"] = np.asarray(label, np.int32)
    return out


def features_fn(tokenizer: WordPieceTokenizer, *, max_seq_length: int, max_predictions_per_seq: int,
                masked_lm_prob: float, whole_word_masking: bool):
    """`f(instance, rng) -> example` (one row of the batches in the module doc), masks drawn
    from the numpy Generator `rng`."""
    replacement_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), sorted(tokenizer.special_ids))
    continuation_ids = np.asarray(tokenizer.continuation_ids) if whole_word_masking else None
    return functools.partial(
        _features, tokenizer=tokenizer, replacement_ids=replacement_ids,
        continuation_ids=continuation_ids, max_seq_length=max_seq_length,
        max_predictions=max_predictions_per_seq, masked_lm_prob=masked_lm_prob)


def pretraining_batch_spec(batch_size: int, max_seq_length: int, max_predictions_per_seq: int,
                           next_sentence: bool = True) -> dict:
    """The shapes and dtypes of `pretraining_dataset`'s batches, without data (tfm.preflight)."""
    spec = {k: jax.ShapeDtypeStruct((batch_size, max_seq_length), np.int32)
            for k in ("input_ids", "token_type_ids", "attention_mask")}
    spec.update({k: jax.ShapeDtypeStruct((batch_size, max_predictions_per_seq), np.int32)
                 for k in ("mlm_positions", "mlm_ids", "mlm_weights")})
    if next_sentence:
        spec["nsp_label"] = jax.ShapeDtypeStruct((batch_size,), np.int32)
    return spec


def pretraining_dataset(documents: Sequence[Sequence[str]], tokenizer: WordPieceTokenizer, *,
                        batch_size: int, max_seq_length: int = 128,
                        max_predictions_per_seq: int = 20, masked_lm_prob: float = 0.15,
                        short_seq_prob: float = 0.1, dupe_factor: int = 1,
                        whole_word_masking: bool = False, next_sentence: bool = True,
                        shuffle: bool = True, seed: int = 0, num_epochs: int | None = None,
                        drop_remainder: bool = True, process_index: int = 0,
                        process_count: int = 1) -> grain.IterDataset:
    """MLM+NSP batches (see module doc) from documents of sentence strings, e.g.
    `tfm.data.sources.documents(load("wikipedia", "train"))`; next_sentence=False gives
    RoBERTa FULL-SENTENCES rows without nsp_label. Whole-word masking needs a tokenizer with
    `continuation_ids` (the ids of word-continuing pieces)."""
    b = host_batch_size(batch_size, process_count)
    tokenized = [[tokenizer.encode(s) for s in doc] for doc in documents]
    if next_sentence:
        instances = create_instances(tokenized, max_seq_length=max_seq_length,
                                     short_seq_prob=short_seq_prob, dupe_factor=dupe_factor,
                                     seed=seed)
    else:
        instances = create_full_sentence_instances(tokenized, max_seq_length=max_seq_length,
                                                   separator_id=tokenizer.sep_id, seed=seed)
    ds = records(instances, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
                 process_index=process_index, process_count=process_count)
    ds = ds.random_map(features_fn(tokenizer, max_seq_length=max_seq_length,
                                   max_predictions_per_seq=max_predictions_per_seq,
                                   masked_lm_prob=masked_lm_prob,
                                   whole_word_masking=whole_word_masking), seed=seed)
    return fixed_batches(ds.to_iter_dataset(), b, drop_remainder)
