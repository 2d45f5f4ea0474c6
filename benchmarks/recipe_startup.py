"""BERT base / large, RoBERTa and translation base recipes started on a generated corpus: each
recipe's own command to the end of its first train step (time, peak host RSS), then its training
stream's examples/s and tokens/s per host core.

    python -m benchmarks.recipe_startup --recipes bert_base,bert_large,roberta --corpus DIR [--work DIR]

runs `experiments.bert.pretrain` with the recipe's config (chunk sizes, shuffle window,
hold-out, vocabulary sample and size, batch, lengths: the data pipeline as the recipe has it)
and `text_dirs=DIR` (e.g. `synthetic.write_text_corpus`'s 5 GB), the model shrunk to D 32 x 1
layer so a CPU takes the step, until "step 1 train" is logged: seconds from the launch and the
process's peak RSS (VmHWM); then kills it. A fresh process then draws the recipe's training
stream (`pretrain.train_stream`, with the vocabulary that run left in its workdir) through one
more shuffle window, timed in CPU seconds: the rate per host core. Workdirs go under --work.

    python -m benchmarks.recipe_startup --translation-pairs 1000000,4500000 --data DIR [--work DIR]

does the same for `experiments.translation.train` with `configs/base.py` (its SentencePiece
sample, token budget, lengths and held-out sets) on the generated corpus of that many pairs,
prepared once under DIR/pairs_<n> (`synthetic.prepare_translation`, streamed to array_record),
with the vocabulary cut to TRANSLATION_VOCAB (the generated language has few words) and the model
shrunk as above; its stream rate is `train.train_stream`'s batches over --batches more steps.

    python -m benchmarks.recipe_startup --translation-rate N --data DIR --workdir W --compare-reads

is that stream rate alone (a fresh workdir W trains the vocabulary first), with the records read in
blocks (`reading.BlockReadIterDataset`) and then, in the same process, one record a call (Grain's
`to_iter_dataset`, the pipelines' former reads); `--data-workers 0,1,2` times the recipe's stream
built by each number of worker processes in turn (wall-clock pairs/s, and CPU with the workers').
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from unittest import mock

import grain

from benchmarks.input_pipeline import cpu_seconds
from experiments import common
from experiments.bert import pretrain
from experiments.bert.configs import base, large, roberta
from experiments.bert.settings import BertSettings
from experiments.translation import train as translation_train
from experiments.translation.configs import base as translation_base
from experiments.translation.settings import TranslationSettings
from tfm.data import documents, pipeline
from tfm.train import MLMTask
from tfm.train.checkpoint import directory_bytes

RECIPES = {"bert_base": base, "bert_large": large, "roberta": roberta}
TINY_MODEL = {"model.overrides.d_model": 32, "model.overrides.num_heads": 2, "model.overrides.num_layers": 1,
              "model.overrides.d_ff": 64}
# Not the data pipeline: bounds the tiny step's own memory on a CPU (RoBERTa's microbatches of
# 512 x 512 and their [rows, 80, 50,265] logits would take ~20 GB).
CPU_STEP = {"roberta": {"microbatches": 64, "task.vocab_chunk": 4096}}
# The generated documents are shorter than Wikipedia's: RoBERTa's 10,000 held-out ones make no full
# held-out batch of 8,192 x 512 here (the recipe refuses to start, naming eval_documents); 30,000 do.
DATA = {"roberta": {"eval_documents": 30_000}}


# The generated En-De language has ~250 words: 1,000 pieces is as far as its SentencePiece goes
# (the recipe's 37,000 cannot be trained on it).
TRANSLATION_VOCAB = 1000


def _data_overrides(recipe: str, corpus: str) -> dict:
    return {"dataset": "", "text_dirs": corpus, **DATA.get(recipe, {})}


def first_step(recipe: str, corpus: str, workdir: str) -> dict:
    """The recipe's command over `corpus` until its first train step is logged; then killed."""
    keys = {**_data_overrides(recipe, corpus), **TINY_MODEL, **CPU_STEP.get(recipe, {})}
    out = _until_first_step(recipe, "experiments.bert.pretrain", RECIPES[recipe].__file__, workdir, keys)
    return {"recipe": recipe, "corpus_bytes": directory_bytes(corpus), **out}


def _until_first_step(recipe: str, module: str, config_file: str, workdir: str, keys: dict) -> dict:
    """`python -m module --config=config_file --workdir=workdir --config.<k>=<v>...` until step 1
    is logged: seconds from the launch and the process's peak RSS then; the process is killed."""
    keys = {**keys, "log_every": 1, "progress_bar": False}
    cmd = [sys.executable, "-m", module, f"--config={config_file}", f"--workdir={workdir}",
           *(f"--config.{k}={v}" for k, v in keys.items())]
    start, log = time.perf_counter(), []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.append(line)
        if line.startswith("step 1 train"):
            seconds = time.perf_counter() - start
            break
    else:
        raise RuntimeError(f"{recipe} ended before its first step:\n" + "".join(log)[-3000:])
    with open(f"/proc/{proc.pid}/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))  # kB
    proc.kill()
    proc.wait()
    return {"seconds_to_first_step": round(seconds, 1), "peak_rss_bytes": peak * 1024,
            "log": [line.rstrip() for line in log if not line.startswith(("I0000", "W0000", "WARNING"))][-8:]}


def _translation_keys(pairs: int, data: str) -> dict:
    return {"dataset": "synthetic_translate", "synthetic_pairs": pairs, "data_dir": os.path.join(data, f"pairs_{pairs}"),
            "vocab_size": TRANSLATION_VOCAB}


def translation_first_step(pairs: int, data: str, workdir: str, extra: dict | None = None) -> dict:
    """The translation base recipe over `pairs` generated pairs until its first train step."""
    keys = {**_translation_keys(pairs, data), **TINY_MODEL, **(extra or {})}
    out = _until_first_step("translation_base", "experiments.translation.train", translation_base.__file__,
                            workdir, keys)
    return {"recipe": "translation_base", "pairs": pairs, "corpus_bytes": directory_bytes(keys["data_dir"]), **out}


# the pipelines' READ_OPTIONS before 2026-11-24, with Grain's one-record reads.
FORMER_READS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)


def translation_rate(pairs: int, data: str, workdir: str, batches: int = 20, one_record_reads: bool = False,
                     workers: int = 0) -> dict:
    """Pairs and real tokens (source + target) per CPU second of the translation base recipe's
    training stream (`train.train_stream`, the SentencePiece model in `workdir`), over `batches`
    batches after the first (CPU: this process and its data workers). `one_record_reads`: with
    Grain's `to_iter_dataset` in place of `reading.BlockReadIterDataset`, one `source[i]` a record
    by FORMER_READS (the pipelines before 2026-11-24). `workers`: the recipe's data_workers."""
    config = translation_base.get_config()
    for k, v in {**_translation_keys(pairs, data), "data_workers": workers}.items():
        config[k] = v
    train, _, _ = translation_train.load_sources(common.settings_of(config, TranslationSettings), workdir)
    former = mock.patch.object(pipeline, "BlockReadIterDataset", lambda ds, read_options: ds.to_iter_dataset(FORMER_READS))
    with former if one_record_reads else contextlib.nullcontext():
        _, exp, data_stream = translation_train.train_stream(config, workdir, train)
    it = iter(data_stream)
    next(it)
    cpu, wall, examples, source, target = cpu_seconds(), time.perf_counter(), 0, 0, 0
    for _ in range(batches):
        b = next(it)
        examples += int(b["inputs_segment_ids"].max(axis=1).sum())
        source, target = source + int((b["inputs_segment_ids"] > 0).sum()), target + int(b["weights"].sum())
    cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    it.close()
    tokens = source + target
    return {"recipe": "translation_base", "reads": "one record a call" if one_record_reads else "blocks",
            "data_workers": workers, "rows": exp.train.batch_size, "batches": batches,
            "source_tokens_per_step": round(source / batches), "target_tokens_per_step": round(target / batches),
            "pairs_per_cpu_second": round(examples / cpu),
            "tokens_per_cpu_second": round(tokens / cpu), "pairs_per_second": round(examples / wall),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def recipe_rate(recipe: str, corpus: str, workdir: str, windows: int = 1, phase: int = 1) -> dict:
    """Examples and real tokens per CPU second of the recipe's training stream in `phase` (1, or
    2: BERT's 512 tokens) with the vocabulary in `workdir`, through `windows` shuffle windows
    after the first batch."""
    config = RECIPES[recipe].get_config()
    for k, v in _data_overrides(recipe, corpus).items():
        config[k] = v
    exp = common.resolve(config, BertSettings, MLMTask)
    s = exp.settings
    docs = pretrain.corpus(s, workdir)
    keys, _ = documents.hold_out(docs, s.eval_documents, seed=exp.train.seed)
    tok = pretrain.tokenizer(s, workdir, docs, keys)
    phase = pretrain.phases(s, exp.train.batch_size)[phase - 1]
    if phase is None:
        raise ValueError(f"{recipe} has one phase")
    stream = pretrain.train_stream(s, phase, docs, tok, keys, seed=exp.train.seed)
    next(stream)
    cpu, wall, rows, tokens = time.process_time(), time.perf_counter(), 0, 0
    while stream.window < windows + 1 and not stream.epoch:
        b = next(stream)
        rows, tokens = rows + len(b["input_ids"]), tokens + int(b["attention_mask"].sum())
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"recipe": recipe, "rows": rows, "max_seq_length": phase.max_seq_length,
            "examples_per_cpu_second": round(rows / cpu, 1), "tokens_per_cpu_second": round(tokens / cpu),
            "examples_per_second": round(rows / wall, 1),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def recipes_table(names: list[str], corpus: str, work: str, rates: bool = True) -> None:
    print("| recipe | corpus | peak RSS to step 1 (MB) | time to step 1 (s) | stream examples/s per core | "
          "tokens/s per core | rate run RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        workdir = os.path.join(work, name)
        if os.path.isdir(workdir):
            raise ValueError(f"{workdir} exists: remove it (a recipe restarts from its checkpoints)")
        first = first_step(name, corpus, workdir)
        if not rates:
            print(f"| {name} | {first['corpus_bytes'] / 2**30:.2f} GiB | {first['peak_rss_bytes'] / 2**20:.0f} | "
                  f"{first['seconds_to_first_step']:.0f} | | | |", flush=True)
            continue
        out = subprocess.run([sys.executable, "-m", "benchmarks.recipe_startup", "--rate", name,
                              "--corpus", corpus, "--work", work], capture_output=True, text=True, check=True)
        rate = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {first['corpus_bytes'] / 2**30:.2f} GiB | {first['peak_rss_bytes'] / 2**20:.0f} | "
              f"{first['seconds_to_first_step']:.0f} | {rate['examples_per_cpu_second']:.0f} | "
              f"{rate['tokens_per_cpu_second']:.0f} | {rate['peak_rss_bytes'] / 2**20:.0f} |", flush=True)
        print(json.dumps({**first, **{f"rate_{k}": v for k, v in rate.items()}}), file=sys.stderr, flush=True)


def _prepare_translation(pairs: int, directory: str) -> None:
    """Writes the generated corpus in a fresh process (streamed to array_record, 3,003 pairs for
    validation and test as the recipe's eval_examples) and prints its time and peak RSS."""
    code = ("import json, resource, time; t = time.perf_counter(); from tfm.data import synthetic; "
            f"synthetic.prepare_translation({directory!r}, train={pairs}, validation=3003, test=3003); "
            "print(json.dumps({'prepare_seconds': round(time.perf_counter() - t), "
            "'prepare_peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    print(f"prepared {pairs:,} pairs in {directory}: {out.stdout.strip().splitlines()[-1]}", flush=True)


def translation_table(pairs: list[int], data: str, work: str, batches: int, spm_sentences: int | None) -> None:
    print("| recipe | pairs | corpus (MB) | peak RSS to step 1 (MB) | time to step 1 (s) | rows × 256 | "
          "tokens per step (src + tgt) | stream pairs/s per core | tokens/s per core | rate run RSS (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in pairs:
        workdir = os.path.join(work, f"translation_base_{n}" + (f"_spm{spm_sentences}" if spm_sentences else ""))
        if os.path.isdir(workdir):
            raise ValueError(f"{workdir} exists: remove it (a recipe restarts from its checkpoints)")
        first = translation_first_step(n, data, workdir, {"spm_sentences": spm_sentences} if spm_sentences else None)
        out = subprocess.run([sys.executable, "-m", "benchmarks.recipe_startup", "--translation-rate", str(n),
                              "--data", data, "--workdir", workdir, "--batches", str(batches)],
                             capture_output=True, text=True, check=True)
        rate = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| translation/base.py{f' spm_sentences={spm_sentences}' if spm_sentences else ''} | {n:,} | "
              f"{first['corpus_bytes'] / 2**20:.0f} | {first['peak_rss_bytes'] / 2**20:.0f} | "
              f"{first['seconds_to_first_step']:.0f} | {rate['rows']} | "
              f"{rate['source_tokens_per_step']:,} + {rate['target_tokens_per_step']:,} | {rate['pairs_per_cpu_second']:,} | "
              f"{rate['tokens_per_cpu_second']:,} | {rate['peak_rss_bytes'] / 2**20:.0f} |", flush=True)
        print(json.dumps({**first, **{f"rate_{k}": v for k, v in rate.items()}}), file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of " + ",".join(RECIPES))
    p.add_argument("--corpus", help="a plain-text corpus directory (BERT / RoBERTa)")
    p.add_argument("--translation-pairs", help="comma-separated corpus sizes for translation base instead")
    p.add_argument("--data", default="/tmp/tfm_translation_bench", help="generated translation corpora go here")
    p.add_argument("--batches", type=int, default=20, help="translation: stream batches timed after the first")
    p.add_argument("--spm-sentences", type=int, help="translation: override the recipe's spm_sentences")
    p.add_argument("--translation-rate", type=int, help="only the translation stream rate at this size (internal)")
    p.add_argument("--workdir", help="with --translation-rate: the first step's workdir (a fresh one trains the vocabulary)")
    p.add_argument("--compare-reads", action="store_true",
                   help="with --translation-rate: also the former one-record reads, in the same process")
    p.add_argument("--data-workers", default="0",
                   help="with --translation-rate: comma-separated data_workers counts, each timed in turn")
    p.add_argument("--work", default="/tmp/tfm_recipe_startup", help="the recipes' workdirs go here")
    p.add_argument("--rate", choices=sorted(RECIPES), help="only the stream rate of one recipe (internal)")
    p.add_argument("--no-rates", action="store_true", help="the first steps only")
    p.add_argument("--phase", type=int, default=1, choices=(1, 2), help="with --rate: the phase streamed")
    args = p.parse_args()
    if args.translation_rate:
        for workers in (int(n) for n in args.data_workers.split(",")):
            print(json.dumps(translation_rate(args.translation_rate, args.data, args.workdir, args.batches,
                                              workers=workers)), flush=True)
        if args.compare_reads:
            print(json.dumps(translation_rate(args.translation_rate, args.data, args.workdir, args.batches, True)))
        return
    if args.translation_pairs:
        pairs = [int(n) for n in args.translation_pairs.split(",")]
        for n in pairs:
            directory = os.path.join(args.data, f"pairs_{n}")
            if not os.path.isdir(directory):
                _prepare_translation(n, directory)
        translation_table(pairs, args.data, args.work, args.batches, args.spm_sentences)
        return
    if not args.corpus:
        p.error("--corpus (or --translation-pairs) is required")
    if args.rate:
        print(json.dumps(recipe_rate(args.rate, args.corpus, os.path.join(args.work, args.rate), phase=args.phase)))
        return
    recipes_table(args.recipes.split(","), args.corpus, args.work, rates=not args.no_rates)


if __name__ == "__main__":
    main()
