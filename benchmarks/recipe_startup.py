"""BERT base / large and RoBERTa recipes started on a generated corpus: each recipe's own
command to the end of its first train step (time, peak host RSS), then its training stream's
examples/s and tokens/s per host core.

    python -m benchmarks.recipe_startup --recipes bert_base,bert_large,roberta --corpus DIR [--work DIR]

runs `experiments.bert.pretrain` with the recipe's config (chunk sizes, shuffle window,
hold-out, vocabulary sample and size, batch, lengths: the data pipeline as the recipe has it)
and `text_dirs=DIR` (e.g. `synthetic.write_text_corpus`'s 5 GB), the model shrunk to D 32 x 1
layer so a CPU takes the step, until "step 1 train" is logged: seconds from the launch and the
process's peak RSS (VmHWM); then kills it. A fresh process then draws the recipe's training
stream (`pretrain.train_stream`, with the vocabulary that run left in its workdir) through one
more shuffle window, timed in CPU seconds: the rate per host core. Workdirs go under --work.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from experiments import common
from experiments.bert import pretrain
from experiments.bert.configs import base, large, roberta
from experiments.bert.settings import BertSettings
from tfm.data import documents
from tfm.train import MLMTask

RECIPES = {"bert_base": base, "bert_large": large, "roberta": roberta}
TINY_MODEL = {"model.overrides.d_model": 32, "model.overrides.num_heads": 2, "model.overrides.num_layers": 1,
              "model.overrides.d_ff": 64}
# Not the data pipeline: bounds the tiny step's own memory on a CPU (RoBERTa's microbatches of
# 512 x 512 and their [rows, 80, 50,265] logits would take ~20 GB).
CPU_STEP = {"roberta": {"microbatches": 64, "task.vocab_chunk": 4096}}
# The generated documents are shorter than Wikipedia's: RoBERTa's 10,000 held-out ones make no full
# held-out batch of 8,192 x 512 here (the recipe refuses to start, naming eval_documents); 30,000 do.
DATA = {"roberta": {"eval_documents": 30_000}}


def _bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(directory) for n in names)


def _data_overrides(recipe: str, corpus: str) -> dict:
    return {"dataset": "", "text_dirs": corpus, **DATA.get(recipe, {})}


def first_step(recipe: str, corpus: str, workdir: str) -> dict:
    """The recipe's command over `corpus` until its first train step is logged; then killed."""
    keys = {**_data_overrides(recipe, corpus), **TINY_MODEL, **CPU_STEP.get(recipe, {}),
            "log_every": 1, "progress_bar": False}
    cmd = [sys.executable, "-m", "experiments.bert.pretrain", f"--config={RECIPES[recipe].__file__}",
           f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in keys.items())]
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
    return {"recipe": recipe, "corpus_bytes": _bytes(corpus), "seconds_to_first_step": round(seconds, 1),
            "peak_rss_bytes": peak * 1024}


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of " + ",".join(RECIPES))
    p.add_argument("--corpus", required=True, help="a plain-text corpus directory")
    p.add_argument("--work", default="/tmp/tfm_recipe_startup", help="the recipes' workdirs go here")
    p.add_argument("--rate", choices=sorted(RECIPES), help="only the stream rate of one recipe (internal)")
    p.add_argument("--no-rates", action="store_true", help="the first steps only")
    p.add_argument("--phase", type=int, default=1, choices=(1, 2), help="with --rate: the phase streamed")
    args = p.parse_args()
    if args.rate:
        print(json.dumps(recipe_rate(args.rate, args.corpus, os.path.join(args.work, args.rate), phase=args.phase)))
        return
    recipes_table(args.recipes.split(","), args.corpus, args.work, rates=not args.no_rates)


if __name__ == "__main__":
    main()
