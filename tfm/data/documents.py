"""Document corpora read lazily, a chunk at a time (BERT/RoBERTa pretraining at full scale).

A corpus is a sequence of chunks: `len(corpus)` chunks, `corpus.chunk(c)` -> the documents of
chunk c as (key, sentences) pairs, read from disk on demand. Nothing is held between calls,
so host memory is bounded by one chunk whatever the corpus size. Keys name a document
stably (they do not depend on the chunk size); sentences are `sources.split_sentences`'s.

    TfdsDocuments(sources.load("wikipedia", "train"), chunk_documents=2000)   # key: the index
    TextDocuments(["/data/books"], chunk_bytes=8 << 20)       # key: (file number, byte offset)
    corpus = Corpus([wiki, books])                             # key: (part, part's key)

`hold_out` carves held-out documents off a corpus by a hash of their keys, reading only a few
chunks; `sample` gives a bounded deterministic sample of documents (tokenizer training).

Plain text is decoded as Google's BERT does (`decode("utf-8", "ignore")`): bytes that are not
UTF-8 are dropped. `TextDocuments` counts them per file when it opens the corpus and says so
once (`warning: FILE: N undecodable bytes dropped`, on stderr), and refuses, naming it, a file
of which more than NOT_TEXT_SHARE is undecodable: not text at all.
"""
from __future__ import annotations

import codecs
import hashlib
import os
import sys
from typing import Hashable, Iterator, Sequence

import numpy as np

from tfm.data.sources import as_text, split_sentences

Document = tuple[Hashable, list[str]]  # (key, sentences)
NOT_TEXT_SHARE = 0.01  # a file with more undecodable bytes than this share is refused
_READ_BLOCK = 8 << 20


class TfdsDocuments:
    """A random-access source (e.g. `sources.load("wikipedia", "train")`) in chunks of
    `chunk_documents` consecutive examples (the last takes the remainder); a document is one
    example's `text_key` feature, split into sentences; empty ones are skipped."""

    def __init__(self, source: Sequence[dict], chunk_documents: int, text_key: str = "text"):
        if chunk_documents < 2:
            raise ValueError(f"chunk_documents must be >= 2 (NSP draws from the chunk), got {chunk_documents}")
        if len(source) == 0:
            raise ValueError("the document source is empty")
        self.source, self.size, self.text_key = source, chunk_documents, text_key
        self.num_chunks = max(1, len(source) // chunk_documents)

    def __len__(self) -> int:
        return self.num_chunks

    def chunk(self, c: int) -> list[Document]:
        start = c * self.size
        stop = len(self.source) if c == self.num_chunks - 1 else start + self.size
        docs = ((i, split_sentences(as_text(self.source[i][self.text_key]))) for i in range(start, stop))
        return [(i, d) for i, d in docs if d]


class TextDocuments:
    """Plain-text files under `directories` (sorted paths, UTF-8), read as one byte stream cut
    into chunks of `chunk_bytes`: a document is a file or a run of lines between blank
    (whitespace-only) lines, and belongs to the chunk where its first line starts, so a chunk
    reads its own bytes plus the end of its last document. Only the file sizes are kept."""

    def __init__(self, directories: Sequence[str | os.PathLike], chunk_bytes: int):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.paths = []
        for directory in directories:
            if not os.path.isdir(directory):
                raise ValueError(f"text corpus directory {os.fspath(directory)!r} does not exist")
            self.paths += sorted(os.path.join(root, name) for root, _, names in os.walk(directory)
                                 for name in names)
        for path in self.paths:
            _check_text(path)
        sizes = np.array([os.path.getsize(p) for p in self.paths], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # file f spans [starts[f], starts[f+1])
        if not self.starts[-1]:
            raise ValueError(f"no text in the files under {[os.fspath(d) for d in directories]}")
        self.size = chunk_bytes
        self.num_chunks = int(-(-self.starts[-1] // chunk_bytes))

    def __len__(self) -> int:
        return self.num_chunks

    def chunk(self, c: int) -> list[Document]:
        lo, hi = c * self.size, min((c + 1) * self.size, int(self.starts[-1]))
        out = []
        for f in range(int(np.searchsorted(self.starts, lo, "right")) - 1, len(self.paths)):
            if self.starts[f] >= hi:
                break
            begin, end = max(lo - int(self.starts[f]), 0), hi - int(self.starts[f])
            out += [((f, at), split_sentences(text.decode("utf-8", "ignore")))
                    for at, text in _file_documents(self.paths[f], begin, end)]
        return [(key, d) for key, d in out if d]


def undecodable_bytes(path: str) -> int:
    """How many bytes of the file at `path` are not UTF-8 (read in blocks: memory stays bounded)."""
    bad = 0

    def count(error: UnicodeDecodeError):
        nonlocal bad
        bad += error.end - error.start
        return "", error.end

    codecs.register_error("tfm_count_undecodable", count)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="tfm_count_undecodable")
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            decoder.decode(block)
    decoder.decode(b"", final=True)
    return bad


def _check_text(path: str) -> None:
    """Refuses a file that is not text; warns once about one whose few undecodable bytes will be dropped."""
    bad, size = undecodable_bytes(path), os.path.getsize(path)
    if bad > NOT_TEXT_SHARE * size:
        raise ValueError(f"{path}: {bad} of its {size} bytes ({bad / size:.0%}) are not UTF-8: not a text file; "
                         f"remove it from the corpus directory")
    if bad:
        print(f"warning: {path}: {bad} undecodable bytes dropped", file=sys.stderr)


def _blank_before(f, pos: int) -> bool:
    """Whether bytes [line start, pos) of the line ending at or after `pos` are whitespace."""
    while pos > 0:
        step = min(pos, 4096)
        f.seek(pos - step)
        piece = f.read(step)
        for byte in reversed(piece):
            if byte == 10:  # "\n"
                return True
            if byte not in b" \t\r\x0b\x0c":  # ASCII whitespace, as bytes.strip()
                return False
        pos -= step
    return True


def _file_documents(path: str, begin: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the documents of `path` whose first line starts in [begin, end)."""
    with open(path, "rb") as f:
        blank = True  # whether the line before the current one is blank (or absent)
        if begin:
            f.seek(begin - 1)
            tail = f.readline()  # the rest of the line holding byte begin - 1
            blank = not tail.strip() and _blank_before(f, begin - 1)
            f.seek(begin - 1 + len(tail))
        lines, at = [], 0
        while True:
            pos, line = f.tell(), f.readline()
            if not line:
                break
            if not line.strip():
                if lines:
                    yield at, b"".join(lines)
                lines, blank = [], True
                continue
            if blank:
                if pos >= end:
                    break
                lines, at = [line], pos
            elif lines:
                lines.append(line)
            blank = False
        if lines:
            yield at, b"".join(lines)


class Corpus:
    """Parts (TfdsDocuments, TextDocuments) as one sequence of chunks; keys (part, key)."""

    def __init__(self, parts: Sequence):
        if not parts:
            raise ValueError("a corpus needs at least one part (a dataset or a text directory)")
        self.parts = list(parts)
        self.index = [(p, c) for p, part in enumerate(self.parts) for c in range(len(part))]

    def __len__(self) -> int:
        return len(self.index)

    def chunk(self, c: int) -> list[Document]:
        p, local = self.index[c]
        return [((p, key), d) for key, d in self.parts[p].chunk(local)]


def key_hash(key: Hashable) -> int:
    """A stable 64-bit hash of a document key (Python's hash() changes between processes)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def chunk_order(num_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """The chunks in epoch `epoch`'s order (the same on every host)."""
    return np.random.default_rng([seed, epoch]).permutation(num_chunks)


_HOLD_OUT_ORDER, _SAMPLE_ORDER = 2**32 - 1, 2**32 - 2  # chunk orders of their own, not an epoch's


def hold_out(corpus, count: int, *, seed: int = 0, oversample: int = 8) -> tuple[frozenset, list[list[str]]]:
    """(keys, documents) of `count` held-out documents: the lowest key hashes among the first
    chunks (in a seeded order) that hold `oversample * count` documents, so they spread over
    those chunks and only they are read. The rest of the corpus needs 2 documents (NSP)."""
    if count < 2:
        raise ValueError(f"eval_documents={count}: need at least 2 held-out documents (NSP pairs)")
    seen = []
    for c in chunk_order(len(corpus), seed, _HOLD_OUT_ORDER):
        seen += corpus.chunk(int(c))
        if len(seen) >= oversample * count:
            break
    else:
        if len(seen) < count + 2:
            raise ValueError(f"eval_documents={count}: need 2 <= eval_documents <= {len(seen) - 2} "
                             f"(the corpus has {len(seen)} documents; both sides need 2 for NSP)")
    chosen = sorted(seen, key=lambda kd: key_hash(kd[0]))[:count]
    return frozenset(k for k, _ in chosen), [d for _, d in chosen]


def sample(corpus, count: int, *, exclude: frozenset = frozenset(), seed: int = 0) -> Iterator[list[str]]:
    """The first `count` documents not in `exclude`, chunks in a seeded order: a bounded,
    deterministic sample (e.g. to train a vocabulary), read lazily."""
    if count < 1:
        raise ValueError(f"the sample needs at least one document, got {count}")
    for c in chunk_order(len(corpus), seed, _SAMPLE_ORDER):
        for key, doc in corpus.chunk(int(c)):
            if key not in exclude:
                yield doc
                count -= 1
                if not count:
                    return
