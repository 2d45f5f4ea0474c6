"""BERT MLM+NSP and RoBERTa FULL-SENTENCES batches streamed from a chunked corpus.

Host memory stays bounded whatever the corpus size (DESIGN: streams, not lists):

* Each epoch orders the corpus's chunks by a seeded permutation (the same on every host);
  host `process_index` takes every `process_count`-th, so hosts read disjoint chunks and
  together read the corpus once per epoch.
* A chunk's documents (less `exclude`, the held-out keys) are tokenized and turned into
  instances as BERT's create_pretraining_data does per input shard (`pretraining.
  create_instances`: NSP's random B comes from another document of the same chunk; or
  `create_full_sentence_instances`), seeded by (seed, chunk), so the pairs are the same every
  epoch.
* The instances of `shuffle_chunks` consecutive chunks of the host form a window, shuffled by
  (seed, epoch, window): the shuffle buffer. Only the current window is in memory.
* Instance i of chunk c is masked in epoch e with a Generator seeded by (seed, e, c, i).

The iterator's state is the stream position {"epoch", "window", "index"} (a JSON-able dict,
saved with the checkpoints through `get_state`/`set_state`): a restored iterator rebuilds
the window from the corpus and yields exactly the batches the uninterrupted one would.
"""
from __future__ import annotations

import random
from typing import Iterator

import numpy as np

from tfm.data import documents, pretraining
from tfm.data.pipeline import host_batch_size

Origin = tuple[int, int, int]  # (epoch, chunk, instance index in the chunk)


class PretrainingStream:
    """Checkpointable iterator of this host's fixed-shape batches (`pretraining`'s module doc
    gives their keys and shapes); `num_epochs` None repeats forever. The remainder of a finite
    stream that does not fill a batch is dropped."""

    def __init__(self, corpus, tokenizer, *, batch_size: int, max_seq_length: int = 128,
                 max_predictions_per_seq: int = 20, masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, dupe_factor: int = 1,
                 whole_word_masking: bool = False, next_sentence: bool = True,
                 exclude: frozenset = frozenset(), shuffle_chunks: int = 1, seed: int = 0,
                 num_epochs: int | None = None, process_index: int = 0, process_count: int = 1):
        if not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
        if len(corpus) < process_count:
            raise ValueError(f"the corpus has {len(corpus)} chunks, fewer than the {process_count} hosts; "
                             "use smaller chunks (chunk_documents / chunk_bytes)")
        if shuffle_chunks < 1:
            raise ValueError(f"shuffle_chunks must be >= 1, got {shuffle_chunks}")
        self.corpus, self.tokenizer, self.exclude = corpus, tokenizer, exclude
        self.batch_size = host_batch_size(batch_size, process_count)
        self.create = dict(max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                           dupe_factor=dupe_factor, next_sentence=next_sentence)
        self.features = pretraining.features_fn(
            tokenizer, max_seq_length=max_seq_length, max_predictions_per_seq=max_predictions_per_seq,
            masked_lm_prob=masked_lm_prob, whole_word_masking=whole_word_masking)
        self.shuffle_chunks, self.seed, self.num_epochs = shuffle_chunks, seed, num_epochs
        self.host, self.hosts = process_index, process_count
        self.epoch = self.window = self.index = 0
        self._cached: tuple[tuple[int, int], list] | None = None

    # ------------------------------------------------------------------ where the stream is

    def host_chunks(self, epoch: int) -> np.ndarray:
        """The chunks this host reads in `epoch`, in order."""
        return documents.chunk_order(len(self.corpus), self.seed, epoch)[self.host::self.hosts]

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "window": self.window, "index": self.index}

    def set_state(self, state: dict) -> None:
        if set(state) != {"epoch", "window", "index"}:
            raise ValueError(f"data state with keys {sorted(state)} is not a stream position "
                             "{epoch, window, index} (a checkpoint of the former in-memory pipeline?)")
        self.epoch, self.window, self.index = (int(state[k]) for k in ("epoch", "window", "index"))

    # ------------------------------------------------------------------------------ reading

    def chunk_instances(self, chunk: int) -> list:
        """Instances of one chunk (held-out documents left out); [] if it cannot make any."""
        tok = self.tokenizer
        docs = [[tok.encode(s) for s in d] for key, d in self.corpus.chunk(chunk) if key not in self.exclude]
        seed = self.seed * 2**32 + chunk
        c = self.create
        if c["next_sentence"]:
            if len(docs) < 2:
                return []
            return pretraining.create_instances(docs, max_seq_length=c["max_seq_length"],
                                                short_seq_prob=c["short_seq_prob"],
                                                dupe_factor=c["dupe_factor"], seed=seed)
        if not any(len(s) for d in docs for s in d):
            return []
        return pretraining.create_full_sentence_instances(docs, max_seq_length=c["max_seq_length"],
                                                          separator_id=tok.sep_id, seed=seed)

    def _window(self, epoch: int, window: int) -> list[tuple[Origin, tuple]]:
        if self._cached is None or self._cached[0] != (epoch, window):
            chunks = self.host_chunks(epoch)[window * self.shuffle_chunks:(window + 1) * self.shuffle_chunks]
            pool = [((epoch, int(c), i), inst) for c in chunks
                    for i, inst in enumerate(self.chunk_instances(int(c)))]
            random.Random(f"{self.seed}/{epoch}/{window}").shuffle(pool)
            self._cached = ((epoch, window), pool)
        return self._cached[1]

    def instances(self) -> Iterator[tuple[Origin, tuple]]:
        """(origin, instance) from the current position on, advancing it."""
        barren = 0  # windows in a row without an instance
        while self.num_epochs is None or self.epoch < self.num_epochs:
            windows = -(-len(self.host_chunks(self.epoch)) // self.shuffle_chunks)
            while self.window < windows:
                pool = self._window(self.epoch, self.window)
                barren = 0 if pool else barren + 1
                if barren > windows:
                    raise ValueError("a whole epoch of this host's chunks gives no instance "
                                     "(too few documents per chunk?)")
                while self.index < len(pool):
                    self.index += 1
                    yield pool[self.index - 1]
                self.window, self.index = self.window + 1, 0
            self.epoch, self.window = self.epoch + 1, 0

    # ----------------------------------------------------------------------------- batches

    def example(self, origin: Origin, instance: tuple) -> dict[str, np.ndarray]:
        return self.features(instance, np.random.default_rng([self.seed, *origin]))

    def __iter__(self) -> PretrainingStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        start, rows = self.get_state(), []
        for origin, instance in self.instances():
            rows.append(self.example(origin, instance))
            if len(rows) == self.batch_size:
                return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        self.set_state(start)  # a finite stream's remainder: dropped, the position kept
        raise StopIteration
