"""How the Grain pipelines (`tfm.data.pipeline`) read records, and in which processes.

`BatchedSource` gives a random-access source Grain's batched read (`_getitems`), which Grain's
shuffle, repeat, slice, map and filter pass down; `BlockReadIterDataset` turns such a MapDataset
into a stream read READ_BLOCK indices a call (Grain's `to_iter_dataset` reads one), with Grain's
iterator state. `in_workers` runs a stream in worker processes (Grain's `mp_prefetch`) with a state
that names their count.
"""
from __future__ import annotations

import collections
from concurrent import futures
from typing import Any, Sequence

import grain
from absl import flags

from tfm.data.sources import read

# Records are read READ_BLOCK at a time: one `sources.read` call (TFDS array_record's `__getitems__`:
# ~30 us a record, against ~1.3 ms for a call of one) that also maps (tokenizes) and filters them.
# READ_OPTIONS: in the consuming thread. Reader threads (`num_threads` > 0, `prefetch_buffer_size`
# records ahead, rounded up to whole blocks) contend for the GIL: translation base's packed stream
# from array_record did 10.0k pairs per CPU second with none, 9.7k with one, 5.6k with two
# (benchmarks/RESULTS.md, 2026-11-24); more cores come from worker processes (`in_workers`).
# Order and iterator state do not depend on these.
READ_BLOCK = 256
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class BatchedSource:
    """`source` with Grain's batched read (`_getitems`, which Grain's shuffle, repeat, slice, map
    and filter pass down to the source): many records a `sources.read` call."""

    def __init__(self, source: Sequence[Any]):
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Any:
        return self._source[index]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        return read(self._source, indices)


class BlockReadIterDataset(grain.IterDataset):
    """`parent`'s elements in order, skipping None (what `filter` leaves), read `block` indices a
    call of Grain's batched `_getitems` (down to one `sources.read` of the source), in the
    consuming thread or by `read_options.num_threads` threads ahead of it: Grain's
    `to_iter_dataset` reads one index a call. Its iterator's state is Grain's ({"next_index": the next parent index}), so
    checkpoints carry over, and resuming at any index gives the same elements."""

    def __init__(self, parent: grain.MapDataset, *, block: int = READ_BLOCK,
                 read_options: grain.ReadOptions = READ_OPTIONS):
        super().__init__(parent)
        if block < 1:
            raise ValueError(f"block must be at least 1, got {block}")
        self._block, self._read_options = block, read_options

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Reads `parent[sl]` (what Grain's worker processes ask of a source dataset)."""
        if sequential_slice:
            raise ValueError("BlockReadIterDataset slices by stride only (sequential_slice=False)")
        self._parents = (self._parent.slice(sl),)

    def __iter__(self) -> grain.DatasetIterator:
        return _BlockReader(self._parent, self._block, self._read_options)


class _BlockReader(grain.DatasetIterator):
    def __init__(self, parent: grain.MapDataset, block: int, read_options: grain.ReadOptions):
        super().__init__()
        self._map_parent, self._length, self._block = parent, len(parent), block
        threads = read_options.num_threads
        self._ahead = -(-read_options.prefetch_buffer_size // block) if threads else 0
        self._executor = futures.ThreadPoolExecutor(threads) if self._ahead else None
        self._pending: collections.deque = collections.deque()  # blocks being read, in order
        self._elements: collections.deque = collections.deque()  # the current block's rest
        self._next = self._queued = 0  # next index to return / to read

    def _read(self, start: int) -> list:
        return self._map_parent._getitems(range(start, min(start + self._block, self._length)))  # pylint: disable=protected-access

    def _next_block(self) -> list:
        if not self._executor:
            start, self._queued = self._queued, min(self._queued + self._block, self._length)
            return self._read(start)
        while len(self._pending) < self._ahead + 1 and self._queued < self._length:
            self._pending.append(self._executor.submit(self._read, self._queued))
            self._queued = min(self._queued + self._block, self._length)
        return self._pending.popleft().result()

    def __next__(self):
        while True:
            if not self._elements:
                if self._next >= self._length:
                    raise StopIteration
                self._elements.extend(self._next_block())
            element = self._elements.popleft()
            self._next += 1
            if element is not None:
                return element

    def get_state(self) -> dict:
        return {"next_index": self._next}

    def set_state(self, state: dict) -> None:
        index = state["next_index"]
        if not 0 <= index <= self._length:
            raise IndexError(f"checkpoint next_index {index} is out of range for {self._length} records")
        while self._pending:
            self._pending.popleft().cancel()
        self._elements.clear()
        self._next = self._queued = index

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._pending:
            self._pending.popleft().cancel()
        if self._executor:
            self._executor.shutdown(wait=False)


def in_workers(ds: grain.IterDataset, workers: int) -> grain.IterDataset:
    """`ds` made by `workers` processes (0: in this one), with Grain's `mp_prefetch`: worker i
    builds its batches from every `workers`-th of the records `ds` reads (packing included) and
    the stream takes the workers' batches in turn. Deterministic and resumable for a given
    `workers`; another count gives other batches, so resuming a state with another fails."""
    if workers < 0:
        raise ValueError(f"workers must be >= 0 (0: in this process), got {workers}")
    if workers and not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # Grain's workers read its absl flags: their defaults, unless a launcher parsed them
    return WorkersIterDataset(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else ds,
                              workers)


class WorkersIterDataset(grain.IterDataset):
    """`parent` (made by `workers` processes) whose iterator state names the worker count:
    {"workers": n, "stream": parent's state}, or parent's own state when n is 0 (as before)."""

    def __init__(self, parent: grain.IterDataset, workers: int):
        super().__init__(parent)
        self._workers = workers

    def __iter__(self) -> grain.DatasetIterator:
        return _WorkersIterator(iter(self._parent), self._workers)


class _WorkersIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, workers: int):
        super().__init__(parent)
        self._workers = workers

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict:
        state = self._parent.get_state()
        return {"workers": self._workers, "stream": state} if self._workers else state

    def set_state(self, state: dict) -> None:
        made_by = state.get("workers", 0)
        if made_by != self._workers:
            raise ValueError(f"the checkpointed data stream was made by {made_by} worker processes; "
                             f"{self._workers} would give other batches: resume with {made_by}")
        self._parent.set_state(state["stream"] if made_by else state)
