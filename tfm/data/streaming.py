"""BERT MLM+NSP and RoBERTa FULL-SENTENCES batches streamed from a chunked corpus.

Host memory stays bounded whatever the corpus size (docs/DESIGN.md: streams, not lists):

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

With `workers` > 0, that many processes build the next windows' examples (instances and masks,
pure functions of the position) while the training process stacks batches from the current one:
the same batches and states as in-process, whatever the count; host memory grows by one window
of masked examples per worker.
"""
from __future__ import annotations

import multiprocessing
import random
from concurrent import futures
from typing import Callable, Iterator, Sequence

import numpy as np

from tfm.data import documents, pretraining
from tfm.data.pipeline import host_batch_size

Origin = tuple[int, int, int]  # (epoch, chunk, instance index in the chunk)
Window = tuple[int, int]  # (epoch, window)


class _Rows:
    """A window's examples stacked ([n, ...] per key; none: n = 0)."""

    def __init__(self, arrays: dict[str, np.ndarray], n: int):
        self.arrays, self.n = arrays, n

    def __len__(self) -> int:
        return self.n


_WORKER_STREAM: "PretrainingStream | None" = None  # the stream a worker process builds windows of


def _start_worker(stream: "PretrainingStream") -> None:
    global _WORKER_STREAM
    _WORKER_STREAM = stream


def _build_window(window: Window) -> _Rows:
    return _WORKER_STREAM.window_rows(*window)


class PretrainingStream:
    """Checkpointable iterator of this host's fixed-shape batches (`pretraining`'s module doc
    gives their keys and shapes); `num_epochs` None repeats forever. The remainder of a finite
    stream that does not fill a batch is dropped."""

    def __init__(self, corpus, tokenizer, *, batch_size: int, max_seq_length: int = 128,
                 max_predictions_per_seq: int = 20, masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, dupe_factor: int = 1,
                 whole_word_masking: bool = False, next_sentence: bool = True,
                 exclude: frozenset = frozenset(), shuffle_chunks: int = 1, seed: int = 0,
                 num_epochs: int | None = None, process_index: int = 0, process_count: int = 1,
                 workers: int = 0):
        if not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
        if len(corpus) < process_count:
            raise ValueError(f"the corpus has {len(corpus)} chunks, fewer than the {process_count} hosts; "
                             "use smaller chunks (chunk_documents / chunk_bytes)")
        if shuffle_chunks < 1:
            raise ValueError(f"shuffle_chunks must be >= 1, got {shuffle_chunks}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0: in this process), got {workers}")
        self.corpus, self.tokenizer, self.exclude = corpus, tokenizer, exclude
        self.batch_size = host_batch_size(batch_size, process_count)
        self.create = dict(max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                           dupe_factor=dupe_factor, next_sentence=next_sentence)
        self.features = pretraining.features_fn(
            tokenizer, max_seq_length=max_seq_length, max_predictions_per_seq=max_predictions_per_seq,
            masked_lm_prob=masked_lm_prob, whole_word_masking=whole_word_masking)
        self.shuffle_chunks, self.seed, self.num_epochs = shuffle_chunks, seed, num_epochs
        self.host, self.hosts, self.workers = process_index, process_count, workers
        self.epoch = self.window = self.index = 0
        self._cached: tuple[Window, list] | None = None
        self._rows: tuple[Window, _Rows] | None = None  # the current window's, with workers
        self._pending: dict[Window, futures.Future] = {}
        self._pool: futures.ProcessPoolExecutor | None = None

    def __getstate__(self) -> dict:
        """What a worker process gets: the stream's settings, no window or pool."""
        return {**self.__dict__, "_cached": None, "_rows": None, "_pending": {}, "_pool": None}

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

    def window_count(self, epoch: int) -> int:
        return -(-len(self.host_chunks(epoch)) // self.shuffle_chunks)

    def _walk(self, load: Callable[[int, int], Sequence]) -> Iterator[Sequence]:
        """`load(epoch, window)` of each window from the current position on; the consumer
        advances `index` through it, then the position moves to the next window."""
        barren = 0  # windows in a row without an instance
        while self.num_epochs is None or self.epoch < self.num_epochs:
            windows = self.window_count(self.epoch)
            while self.window < windows:
                rows = load(self.epoch, self.window)
                barren = 0 if len(rows) else barren + 1
                if barren > windows:
                    raise ValueError("a whole epoch of this host's chunks gives no instance "
                                     "(too few documents per chunk?)")
                yield rows
                self.window, self.index = self.window + 1, 0
            self.epoch, self.window = self.epoch + 1, 0

    def instances(self) -> Iterator[tuple[Origin, tuple]]:
        """(origin, instance) from the current position on, advancing it."""
        for pool in self._walk(self._window):
            while self.index < len(pool):
                self.index += 1
                yield pool[self.index - 1]

    # ------------------------------------------------------------------------ worker processes

    def window_rows(self, epoch: int, window: int) -> _Rows:
        """The window's examples in stream order, stacked: what a worker builds."""
        rows = [self.example(origin, instance) for origin, instance in self._window(epoch, window)]
        return _Rows({k: np.stack([r[k] for r in rows]) for k in rows[0]} if rows else {}, len(rows))

    def _following(self, start: Window, count: int) -> list[Window]:
        """`count` windows of the stream from `start` on (fewer at a finite stream's end)."""
        out, (epoch, window) = [], start
        while len(out) < count and (self.num_epochs is None or epoch < self.num_epochs):
            out.append((epoch, window))
            epoch, window = (epoch, window + 1) if window + 1 < self.window_count(epoch) else (epoch + 1, 0)
        return out

    def _window_rows(self, epoch: int, window: int) -> _Rows:
        """The window's rows from the workers, which build the next `workers` windows meanwhile."""
        if self._rows is None or self._rows[0] != (epoch, window):
            if self._pool is None:
                self._pool = futures.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                         initializer=_start_worker, initargs=(self,))
            wanted = self._following((epoch, window), self.workers + 1)
            for key in [k for k in self._pending if k not in wanted]:
                self._pending.pop(key).cancel()
            for key in wanted:
                if key not in self._pending:
                    self._pending[key] = self._pool.submit(_build_window, key)
            self._rows = ((epoch, window), self._pending.pop((epoch, window)).result())
        return self._rows[1]

    def close(self) -> None:
        """Stops the worker processes, once the window each is building is done (a later batch
        starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._pending = None, {}

    # ----------------------------------------------------------------------------- batches

    def example(self, origin: Origin, instance: tuple) -> dict[str, np.ndarray]:
        return self.features(instance, np.random.default_rng([self.seed, *origin]))

    def __iter__(self) -> PretrainingStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.workers:
            return self._next_from_workers()
        start, rows = self.get_state(), []
        for origin, instance in self.instances():
            rows.append(self.example(origin, instance))
            if len(rows) == self.batch_size:
                return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        self.set_state(start)  # a finite stream's remainder: dropped, the position kept
        raise StopIteration

    def _next_from_workers(self) -> dict[str, np.ndarray]:
        start, parts, need = self.get_state(), [], self.batch_size
        for rows in self._walk(self._window_rows):
            take = min(need, len(rows) - self.index)
            if take > 0:
                parts.append({k: v[self.index:self.index + take] for k, v in rows.arrays.items()})
                self.index, need = self.index + take, need - take
            if not need:
                return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        self.set_state(start)  # as in-process: a finite stream's remainder is dropped
        raise StopIteration
