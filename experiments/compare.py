"""Runs side by side: what their configs set differently, their final and best metrics, their curves.

    python -m experiments.compare WORKDIR [WORKDIR ...] [--metric loss] [--plot curves.png]

Each WORKDIR is a run's (any experiment's): its newest config record (config.json, or the
config.step<N>.json a changed resume wrote) and its metrics.jsonl. Prints the config keys whose values
differ between the runs (flattened: `optimizer.learning_rate`, `model_config.position`), then per split
and metric the final value and the best one (lowest for a loss or perplexity, highest otherwise) with
its step; --plot draws --metric against the step, one colour per run, eval solid and train dashed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from tfm.train.resume import flat, latest_record

# logged beside the metrics, but not a result of the run (speeds, the schedule, a flag)
NOT_RESULTS = ("step", "split", "step_time", "tokens_per_s", "mfu", "lr", "finite", "grad_norm")


def load(workdir: str) -> dict:
    """{"config": the flattened newest config record, "records": metrics.jsonl's records}."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise ValueError(f"{workdir} has no metrics.jsonl: give the --workdir of a run")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    record = latest_record(workdir)
    config = {}
    if os.path.isfile(record):
        with open(record) as f:
            config = flat(json.load(f))
    return {"config": config, "records": records}


def config_diff(runs: dict) -> dict:
    """{key: [its value in each run]} for the flattened config keys whose values differ ("(unset)"
    where a run has no such key)."""
    keys = sorted(set().union(*(r["config"] for r in runs.values())))
    values = {k: [r["config"].get(k, "(unset)") for r in runs.values()] for k in keys}
    return {k: v for k, v in values.items() if any(x != v[0] for x in v)}


def lower_is_better(metric: str) -> bool:
    return "loss" in metric or "perplexity" in metric


def summary(records: list[dict]) -> dict:
    """{(split, metric): (final value, best value, step of the best)}, over the records in step order."""
    out = {}
    for r in sorted(records, key=lambda r: r["step"]):
        for metric, value in r.items():
            if metric in NOT_RESULTS or not isinstance(value, (int, float)):
                continue
            key = (r["split"], metric)
            _, best, at = out.get(key, (None, None, None))
            better = best is None or (value < best if lower_is_better(metric) else value > best)
            out[key] = (value, value if better else best, r["step"] if better else at)
    return out


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def report(runs: dict) -> str:
    """The config differences and the metrics of `runs` ({name: load(workdir)}) as Markdown tables."""
    names = list(runs)
    diff = config_diff(runs)
    out = ["config keys that differ:", table(["key", *names], [[k, *map(str, v)] for k, v in diff.items()])
           if diff else "(none: the runs have the same config)", ""]
    sums = {name: summary(r["records"]) for name, r in runs.items()}
    keys = sorted(set().union(*sums.values()), key=lambda k: (k[0] != "eval", k))
    rows = []
    for split, metric in keys:
        cells = []
        for name in names:
            final, best, at = sums[name].get((split, metric), (None, None, None))
            cells.append("-" if final is None else f"{final:.4g} (best {best:.4g} at step {at})")
        rows.append([split, metric, *cells])
    out += ["final and best (lowest loss / perplexity, highest otherwise):",
            table(["split", "metric", *names], rows)]
    return "\n".join(out)


def plot(path: str, runs: dict, metric: str) -> None:
    """`metric` against the step for every run: eval solid, train dashed, one colour per run."""
    from matplotlib.figure import Figure  # not pyplot: a notebook's inline backend stays as it is
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    drawn = 0
    for i, (name, run) in enumerate(runs.items()):
        for split, style in (("eval", "-"), ("train", "--")):
            points = sorted((r["step"], r[metric]) for r in run["records"] if r["split"] == split and metric in r)
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", marker="o" if split == "eval" else None,
                        markersize=3, label=f"{name} ({split})")
                drawn += 1
    if not drawn:
        raise ValueError(f"no run logged {metric!r}; metrics logged: "
                         f"{sorted({m for r in runs.values() for rec in r['records'] for m in rec} - set(NOT_RESULTS))}")
    ax.set(xlabel="step", ylabel=metric)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def names(workdirs: list[str]) -> list[str]:
    """Each run's name: its workdir, less the part all of them share at the start."""
    common = os.path.commonpath([os.path.abspath(w) for w in workdirs]) if len(workdirs) > 1 else ""
    return [os.path.relpath(os.path.abspath(w), common) if common else w.rstrip("/") for w in workdirs]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+", help="the runs' --workdir")
    parser.add_argument("--metric", default="loss", help="what --plot draws (default: loss)")
    parser.add_argument("--plot", default=None, help="a PNG path for the curves")
    args = parser.parse_args(argv)
    try:
        runs = {name: load(w) for name, w in zip(names(args.workdirs), args.workdirs)}
        print(report(runs))
        if args.plot:
            plot(args.plot, runs, args.metric)
            print(f"\n{args.metric} against the step: {args.plot}")
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
