"""Grain input pipelines: tokenize, filter/truncate, pack or pad, batch, shard per host.

Every pipeline is deterministic given `seed` and returns a `grain.IterDataset`; `iter()` of
it is a `grain.DatasetIterator` whose `get_state()` / `set_state(state)` the training loop
stores in checkpoints (the state is a small JSON-able dict).

Reading (`tfm.data.reading`): records are read a block at a time (one `__getitems__` call of the
TFDS source per block, tokenized in the same call), never one per call; the batches and the state
are those of one-record reads. `workers` > 0 builds the batches in that many processes
(`reading.in_workers`, Grain's `mp_prefetch`): other batches than in-process, deterministic for
the count.

Host sharding: all hosts shuffle the records with the same seed, then host `process_index`
keeps every `process_count`-th record, so hosts read disjoint records and, without
filtering or packing, batch k of all hosts together is batch k of a single-host run.
`batch_size` is the global batch; each host yields `batch_size // process_count` rows.

Outputs are dicts of int32 numpy arrays of fixed shape (b = per-host batch):

    lm_dataset:      inputs, targets, segment_ids, positions, weights          [b, L]
    seq2seq_dataset: inputs, inputs_segment_ids, inputs_positions               [b, S]
                     targets_in, targets, targets_segment_ids,
                     targets_positions, weights                                 [b, T]

Segment ids number the examples packed in a row 1, 2, 3, ... (0 = padding); positions
restart at 0 in every segment; weights are 1 on real target tokens. Unpacked rows hold one
segment. `targets_in` is the decoder input: BOS followed by the target tokens; `targets`
are the target tokens followed by EOS. For LM, inputs = [BOS] + tokens and targets =
tokens + [EOS], so no prediction crosses a segment boundary.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import grain
import jax
import numpy as np

from tfm.data.reading import READ_OPTIONS, BatchedSource, BlockReadIterDataset, in_workers
from tfm.data.sources import as_text
from tfm.data.tokenizers import Tokenizer

Example = dict[str, np.ndarray]

def records(source: Sequence[Any], *, shuffle: bool, seed: int, num_epochs: int | None,
            process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """This host's records: shuffled per epoch (same permutation on every host),
    repeated `num_epochs` times (None = forever), then every `process_count`-th."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got "
                         f"{process_index}, {process_count}")
    if len(source) == 0:
        raise ValueError("the data source is empty")
    ds = grain.MapDataset.source(BatchedSource(source))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds[process_index::process_count]


def host_batch_size(batch_size: int, process_count: int) -> int:
    if batch_size <= 0 or batch_size % process_count:
        raise ValueError(f"global batch_size {batch_size} must be a positive multiple of "
                         f"process_count {process_count}")
    return batch_size // process_count


def _int32(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def _pad_one(ex: Example, lengths: dict[str, int]) -> Example:
    """One example as a row with a single segment: the layout packing produces."""
    out = {}
    for key, length in lengths.items():
        n = len(ex[key])
        out[key] = np.pad(ex[key], (0, length - n))
        out[f"{key}_segment_ids"] = _int32([1] * n + [0] * (length - n))
        out[f"{key}_positions"] = np.pad(np.arange(n, dtype=np.int32), (0, length - n))
    return out


def _pack_or_pad(ds: grain.IterDataset, lengths: dict[str, int], *, pack: bool,
                 num_bins: int, shuffle: bool, seed: int) -> grain.IterDataset:
    if not pack:
        return ds.map(functools.partial(_pad_one, lengths=lengths))
    return grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=num_bins, shuffle_bins=shuffle, seed=seed)


def _stack(rows: Sequence[Example], batch_size: int) -> Example:
    """Stacks rows; a short final batch is filled with all-padding rows (weights 0)."""
    out = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    missing = batch_size - len(rows)
    return {k: np.pad(v, [(0, missing)] + [(0, 0)] * (v.ndim - 1)) if missing else v
            for k, v in out.items()}


def fixed_batches(ds: grain.IterDataset, batch_size: int, drop_remainder: bool) -> grain.IterDataset:
    return ds.batch(batch_size, drop_remainder=drop_remainder,
                    batch_fn=functools.partial(_stack, batch_size=batch_size))


# ---------------------------------------------------------------------------- language model


def _lm_example(ex: dict, tokenizer: Tokenizer, text_key: str, seq_len: int) -> Example:
    ids = tokenizer.encode(as_text(ex[text_key]))
    return {"inputs": _int32(([tokenizer.bos_id] + ids)[:seq_len]),
            "targets": _int32((ids + [tokenizer.eos_id])[:seq_len])}


def _lm_output(ex: Example) -> Example:
    seg = ex["inputs_segment_ids"]
    return {"inputs": ex["inputs"], "targets": ex["targets"], "segment_ids": seg,
            "positions": ex["inputs_positions"], "weights": (seg > 0).astype(np.int32)}


def lm_batch_spec(batch_size: int, seq_len: int) -> dict:
    """The shapes and dtypes of `lm_dataset`'s batches, without data (tfm.preflight)."""
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), np.int32)
            for k in ("inputs", "targets", "segment_ids", "positions", "weights")}


def lm_dataset(source: Sequence[dict], tokenizer: Tokenizer, *, batch_size: int,
               seq_len: int, text_key: str = "text", pack: bool = True,
               shuffle: bool = True, seed: int = 0, num_epochs: int | None = None,
               drop_remainder: bool = True, process_index: int = 0, process_count: int = 1,
               num_packing_bins: int | None = None,
               read_options: grain.ReadOptions = READ_OPTIONS, workers: int = 0) -> grain.IterDataset:
    """Decoder-LM batches {inputs, targets, segment_ids, positions, weights}: [b, seq_len].

    Texts longer than seq_len tokens are truncated (lm1b sentences rarely are). `workers`: see
    `in_workers`.
    """
    b = host_batch_size(batch_size, process_count)
    ds = records(source, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
                 process_index=process_index, process_count=process_count)
    ds = ds.map(functools.partial(_lm_example, tokenizer=tokenizer, text_key=text_key,
                                  seq_len=seq_len))
    ds = BlockReadIterDataset(ds, read_options=read_options)
    ds = _pack_or_pad(ds, {"inputs": seq_len, "targets": seq_len}, pack=pack,
                      num_bins=num_packing_bins or b, shuffle=shuffle, seed=seed)
    return in_workers(fixed_batches(ds.map(_lm_output), b, drop_remainder), workers)


# ------------------------------------------------------------------------ sequence to sequence


def _seq2seq_example(ex: dict, src_tok: Tokenizer, tgt_tok: Tokenizer, src_key: str,
                     tgt_key: str) -> Example:
    src = src_tok.encode(as_text(ex[src_key]))
    tgt = tgt_tok.encode(as_text(ex[tgt_key]))
    return {"inputs": _int32(src + [src_tok.eos_id]),
            "targets_in": _int32([tgt_tok.bos_id] + tgt),
            "targets": _int32(tgt + [tgt_tok.eos_id])}


def _fits(ex: Example, max_length: int) -> bool:
    return len(ex["inputs"]) <= max_length and len(ex["targets"]) <= max_length


def _seq2seq_output(ex: Example) -> Example:
    keys = ("inputs", "inputs_segment_ids", "inputs_positions", "targets_in", "targets",
            "targets_segment_ids", "targets_positions")
    out = {k: ex[k] for k in keys}
    out["weights"] = (ex["targets_segment_ids"] > 0).astype(np.int32)
    return out


def seq2seq_batch_spec(batch_size: int, max_length: int) -> dict:
    """The shapes and dtypes of `seq2seq_dataset`'s batches, without data (tfm.preflight)."""
    keys = ("inputs", "inputs_segment_ids", "inputs_positions", "targets_in", "targets",
            "targets_segment_ids", "targets_positions", "weights")
    return {k: jax.ShapeDtypeStruct((batch_size, max_length), np.int32) for k in keys}


def seq2seq_dataset(source: Sequence[dict], tokenizer: Tokenizer, *, batch_size: int,
                    max_length: int = 256, src_key: str = "en", tgt_key: str = "de",
                    target_tokenizer: Tokenizer | None = None, pack: bool = True,
                    shuffle: bool = True, seed: int = 0, num_epochs: int | None = None,
                    drop_remainder: bool = True, process_index: int = 0,
                    process_count: int = 1,
                    num_packing_bins: int | None = None,
                    read_options: grain.ReadOptions = READ_OPTIONS, workers: int = 0) -> grain.IterDataset:
    """Translation batches (see module doc), S = T = max_length.

    Pairs where either side (with EOS) exceeds max_length tokens are dropped. One tokenizer
    serves both sides (shared vocabulary) unless `target_tokenizer` is given. `workers`: see
    `in_workers`.
    """
    b = host_batch_size(batch_size, process_count)
    ds = records(source, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
                 process_index=process_index, process_count=process_count)
    ds = ds.map(functools.partial(_seq2seq_example, src_tok=tokenizer,
                                  tgt_tok=target_tokenizer or tokenizer,
                                  src_key=src_key, tgt_key=tgt_key))
    ds = BlockReadIterDataset(ds.filter(functools.partial(_fits, max_length=max_length)),
                              read_options=read_options)
    lengths = {"inputs": max_length, "targets_in": max_length, "targets": max_length}
    ds = _pack_or_pad(ds, lengths, pack=pack, num_bins=num_packing_bins or b,
                      shuffle=shuffle, seed=seed)
    return in_workers(fixed_batches(ds.map(_seq2seq_output), b, drop_remainder), workers)


def rows_for_token_budget(source: Sequence[dict], tokenizer: Tokenizer, *, tokens_per_batch: int,
                          max_length: int, multiple: int = 1, sample_rows: int = 512, seed: int = 0,
                          **seq2seq_kwargs) -> int:
    """Global rows per seq2seq batch so that a packed batch holds about `tokens_per_batch` real
    tokens on each side (the paper's ~25k source + ~25k target per step).

    Packs a shuffled sample of `source` exactly as `seq2seq_dataset` does (at the estimated row
    count, twice, since packing fills rows better when there are more of them), measures the
    mean tokens per row of the two sides, and rounds to the nearest multiple of `multiple` (e.g. the
    device count). Deterministic: every host computes the same number.
    """
    rows = max(multiple, -(-tokens_per_batch // max_length))
    for _ in range(2):
        ds = seq2seq_dataset(source, tokenizer, batch_size=rows, max_length=max_length, seed=seed,
                             num_epochs=1, **seq2seq_kwargs)
        src = tgt = used = 0
        for batch, _ in zip(ds, range(max(1, sample_rows // rows))):
            src += int((batch["inputs_segment_ids"] > 0).sum())
            tgt += int(batch["weights"].sum())
            used += len(batch["weights"])
        per_row = (src + tgt) / 2 / max(used, 1)
        rows = max(multiple, round(tokens_per_batch / max(per_row, 1.0) / multiple) * multiple)
    return rows
