"""BERT / RoBERTa pretraining input pipeline at corpus scale: peak host memory and time to the
first batch as the corpus grows, then examples/s and tokens/s of one host core.

    python -m benchmarks.input_pipeline --sizes-mb 100,1000 [--lists-sizes-mb 5,20] [--work DIR]

For each size it writes a Wikipedia-like text corpus (`synthetic.write_text_corpus`, reused
when present, under --work, default /tmp/tfm_input_bench), then runs in a fresh process each
(so peak RSS is that run's own, from `resource.getrusage`): the pipeline to its first batch
(hold-out carve, WordPiece trained on a bounded sample, the first shuffle window), then
`--windows` more shuffle windows (default 2) for throughput per core (CPU seconds), for BERT
phase 1 (MLM + NSP, 128 tokens, 20 predictions) and RoBERTa FULL-SENTENCES (512, 80). At the
`--lists-sizes-mb` sizes the former in-memory path (every document, vocabulary and instance
made before the first batch) runs too, side by side.

    python -m benchmarks.input_pipeline --first-batch DIR [--mode bert|roberta] [--windows N]

is one such run over a corpus directory; it prints one JSON line (tests use it).
`--packing` prints the translation and LM packing pipelines' throughput per core instead, with
the pipeline's Grain read options, 1 and 2 reader threads and Grain's defaults side by side;
`--packing --translation-data DIR` reads the translation pairs from the array_record corpus
`synthetic.prepare_translation` wrote in DIR instead of memory.

    python -m benchmarks.input_pipeline --stream-workers DIR [--mode bert|roberta] [--workers 0,1,2] [--windows N]

times the stream over a corpus directory with each number of worker processes in turn
(`PretrainingStream(workers=n)`), through N shuffle windows after the first batch: wall-clock
examples/s and CPU seconds with the workers'.
"""
from __future__ import annotations

import time

START = time.perf_counter()  # before the imports: a run's time to its first batch includes them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import multiprocessing  # noqa: E402

import grain  # noqa: E402

from tfm.data import documents, pipeline, pretraining, reading, sources, streaming, synthetic, tokenizers  # noqa: E402
from tfm.train.checkpoint import directory_bytes  # noqa: E402

MODES = {"bert": dict(max_seq_length=128, max_predictions_per_seq=20, next_sentence=True),
         "roberta": dict(max_seq_length=512, max_predictions_per_seq=80, next_sentence=False)}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live multiprocessing children (data
    workers), read from /proc."""
    ticks = 0
    for child in multiprocessing.active_children():
        with open(f"/proc/{child.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return time.process_time() + ticks / os.sysconf("SC_CLK_TCK")


def stream_worker_rates(directory: str, mode: str, workers: list[int], windows: int) -> list[dict]:
    """For each worker count, a fresh stream over `directory` (as `run_once`) drawn through
    `windows` shuffle windows after its first batch: examples and real tokens per wall second and
    per CPU second (its workers' included)."""
    corpus = documents.Corpus([documents.TextDocuments([directory], chunk_bytes=1 << 20)])
    keys, _ = documents.hold_out(corpus, 100)
    tok = tokenizers.train_wordpiece((s for d in documents.sample(corpus, 500, exclude=keys) for s in d), 1000)
    out = []
    for n in workers:
        stream = streaming.PretrainingStream(corpus, tok, batch_size=32, exclude=keys, shuffle_chunks=4,
                                             workers=n, **MODES[mode])
        next(stream)
        cpu, wall, tokens, rows = cpu_seconds(), time.perf_counter(), 0, 0
        while stream.window < windows + 1 and not stream.epoch:
            batch = next(stream)
            tokens, rows = tokens + int(batch["attention_mask"].sum()), rows + len(batch["input_ids"])
        cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
        stream.close()
        out.append({"mode": mode, "workers": n, "rows": rows, "examples_per_second": round(rows / wall, 1),
                    "examples_per_cpu_second": round(rows / cpu, 1), "tokens_per_cpu_second": round(tokens / cpu)})
    return out


def run_once(directory: str, mode: str, windows: int, lists: bool = False) -> dict:
    """The pipeline over `directory` to its first batch (timed from the process's imports),
    then through `windows` more shuffle windows (4 chunks of 1 MB each: reading, tokenizing,
    instance creation and masking, for throughput); call it once per process."""
    corpus = documents.Corpus([documents.TextDocuments([directory], chunk_bytes=1 << 20)])
    if lists:  # the former path: every document in memory, the vocabulary and instances made from all
        docs = [d for c in range(len(corpus)) for _, d in corpus.chunk(c)]
        tok = tokenizers.train_wordpiece((s for d in docs for s in d), 1000)
        first = next(iter(pretraining.pretraining_dataset(docs, tok, batch_size=32, **MODES[mode])))
        return {"mode": mode, "pipeline": "lists", "corpus_bytes": directory_bytes(directory), "chunks": len(corpus),
                "seconds_to_first_batch": round(time.perf_counter() - START, 2), "peak_rss_bytes": _peak_rss()}
    keys, _ = documents.hold_out(corpus, 100)
    tok = tokenizers.train_wordpiece(
        (s for d in documents.sample(corpus, 500, exclude=keys) for s in d), 1000)
    stream = streaming.PretrainingStream(corpus, tok, batch_size=32, exclude=keys, shuffle_chunks=4,
                                         **MODES[mode])
    first = next(stream)
    to_first = time.perf_counter() - START
    cpu, wall, tokens, done = time.process_time(), time.perf_counter(), 0, 0
    while windows and stream.window < windows + 1 and not stream.epoch:  # builds `windows` windows
        tokens += int(next(stream)["attention_mask"].sum())
        done += 1
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"mode": mode, "pipeline": "stream", "corpus_bytes": directory_bytes(directory),
            "chunks": len(corpus), "seconds_to_first_batch": round(to_first, 2), "peak_rss_bytes": _peak_rss(),
            "batch_rows": len(first["input_ids"]),
            "examples_per_cpu_second": round(done * 32 / cpu, 1) if done else None,
            "tokens_per_cpu_second": round(tokens / cpu) if done else None,
            "examples_per_second": round(done * 32 / wall, 1) if done else None}


def packing_rates(batches: int = 100, translation_data: str | None = None) -> list[dict]:
    """Examples and real tokens per CPU second of the packed translation and LM pipelines over
    generated sentences held in memory (their sources are random-access TFDS splits):
    `pipeline.seq2seq_dataset` at 64 tokens, batch 32, and at translation base's 256 tokens and
    100 rows; `pipeline.lm_dataset` at 128, batch 32 (tokens: the source side for translation);
    each with the pipeline's read options (blocks read in the consuming thread), 1 and 2 reader
    threads and Grain's defaults, side by side. `translation_data`: a generated array_record
    corpus's directory to read the translation pairs from (else the pairs are in memory)."""
    pairs = synthetic.translation_pairs(60_000, seed=0)
    tok = tokenizers.train_sentencepiece((t for p in pairs[:2000] for t in p), 500)
    translation = ([{"en": e, "de": d} for e, d in pairs] if translation_data is None else
                   sources.load("synthetic_translate", "train", data_dir=translation_data))
    cases = {"translation (seq2seq, 64, 32 rows)": (pipeline.seq2seq_dataset, translation,
                                                    dict(max_length=64, batch_size=32), "inputs_segment_ids"),
             "translation base (seq2seq, 256, 100 rows)": (pipeline.seq2seq_dataset, translation,
                                                           dict(max_length=256, batch_size=100), "inputs_segment_ids"),
             "LM (decoder, 128, 32 rows)": (pipeline.lm_dataset, [{"text": e} for e, _ in pairs],
                                            dict(seq_len=128, batch_size=32), "segment_ids")}
    block = reading.READ_BLOCK
    reads = {"reading.READ_OPTIONS (no reader threads)": reading.READ_OPTIONS,
             "1 reader thread": grain.ReadOptions(num_threads=1, prefetch_buffer_size=block),
             "2 reader threads": grain.ReadOptions(num_threads=2, prefetch_buffer_size=2 * block),
             "grain default (16 threads, 500 ahead)": grain.ReadOptions()}
    out = []
    for name, (make, source, shape, segments) in cases.items():
        for label, read_options in reads.items():
            it = iter(make(source, tok, read_options=read_options, **shape))
            next(it)
            cpu, examples, tokens = time.process_time(), 0, 0
            for _ in range(batches * 32 // shape["batch_size"]):
                b = next(it)
                examples += int(b[segments].max(axis=1).sum())
                tokens += int((b[segments] > 0).sum())
            cpu = time.process_time() - cpu
            out.append({"case": name, "read_options": label, "examples_per_cpu_second": round(examples / cpu),
                        "tokens_per_cpu_second": round(tokens / cpu)})
    return out


def _fresh_process(directory: str, mode: str, windows: int, lists: bool = False) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.input_pipeline", "--first-batch", directory,
                          "--mode", mode, "--windows", str(windows)] + ["--lists"] * lists, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first-batch", metavar="DIR", help="one run over DIR, printed as a JSON line")
    p.add_argument("--mode", choices=sorted(MODES), default="bert")
    p.add_argument("--windows", type=int, default=0, help="shuffle windows after the first, for throughput")
    p.add_argument("--lists", action="store_true", help="with --first-batch: the former in-memory path")
    p.add_argument("--packing", action="store_true", help="translation and LM packing throughput instead")
    p.add_argument("--translation-data", help="with --packing: read the translation pairs from this prepared corpus")
    p.add_argument("--stream-workers", metavar="DIR", help="the stream's rate over DIR with each --workers count")
    p.add_argument("--workers", default="0,1,2", help="with --stream-workers: comma-separated worker counts")
    p.add_argument("--sizes-mb", default="100,1000")
    p.add_argument("--lists-sizes-mb", default="5,20", help="sizes the former in-memory path runs at, side by side")
    p.add_argument("--work", default="/tmp/tfm_input_bench")
    args = p.parse_args()
    if args.packing:
        for r in packing_rates(translation_data=args.translation_data):
            print(json.dumps(r))
        return
    if args.stream_workers:
        for r in stream_worker_rates(args.stream_workers, args.mode, [int(n) for n in args.workers.split(",")],
                                     args.windows or 2):
            print(json.dumps(r), flush=True)
        return
    if args.first_batch:
        print(json.dumps(run_once(args.first_batch, args.mode, args.windows, args.lists)))
        return
    print("| corpus | pipeline | mode | chunks | peak RSS (MB) | first batch (s) | examples/s per core | tokens/s per core |")
    print("|---|---|---|---|---|---|---|---|")
    lists = [int(mb) for mb in args.lists_sizes_mb.split(",") if mb]
    for mb in sorted(set(lists) | {int(mb) for mb in args.sizes_mb.split(",")}):
        directory = os.path.join(args.work, f"{mb}mb")
        if not os.path.isdir(directory):
            synthetic.write_text_corpus(directory, mb << 20, seed=mb)
        runs = [(mode, False) for mode in MODES] + [(mode, True) for mode in MODES if mb in lists]
        for mode, in_memory in runs:
            r = _fresh_process(directory, mode, args.windows or 2, in_memory)
            rate = (f"{r['examples_per_cpu_second']:.0f} | {r['tokens_per_cpu_second']:.0f}"
                    if "examples_per_cpu_second" in r else "— | —")
            print(f"| {r['corpus_bytes'] / 2**20:.0f} MB | {r['pipeline']} | {mode} | {r['chunks']} "
                  f"| {r['peak_rss_bytes'] / 2**20:.0f} | {r['seconds_to_first_batch']:.1f} | {rate} |", flush=True)


if __name__ == "__main__":
    main()
