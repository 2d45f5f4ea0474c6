"""Compile a recipe's real train step for the chips it targets, from any machine.

    python -m experiments.preflight --config=experiments/bert/configs/large.py --target=v5p-16
    python -m experiments.preflight --config=experiments/lm/configs/llama.py --target=h100-8 --json=out.json

Builds the recipe's model, task, optimizer, mesh and Trainer exactly as its `train` does (the
same config schema and `--config.KEY=VALUE` overrides) over compile-only devices of --target,
with no dataset (batch shapes from the config, the vocabulary from its vocab_size). Prints per
chip: memory against HBM with a verdict (and, when it does not fit, the largest arrays and what
would help), model FLOPs, XLA's cost-model step time and the MFU it implies (TPU; named an
estimate), the collectives by kind, the attention kernels and their per-device shapes, and the
compile time. `--kernels_apart` compiles each step with flash kernels a second time, without the
kernels' cost estimates, and reports the kernels' part of the estimated step and the step without it
(`kernel_seconds`, `estimate_seconds_without_kernels` in the JSON too): the figure to set beside a peer
whose kernels carry no cost estimate; it doubles the compile time. Targets:
`tfm.preflight.valid_targets()`. Exit status 0: every step fits; 1: bad input (one line on stderr);
3: a step does not fit.

Needs libtpu (TPU) or jax-cuda12-pjrt (GPU) at the versions that go with the installed jax:
`make compile-plugins` puts them in .venv/compile-only, where this command finds them.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices; nothing runs on them

from tfm import preflight  # noqa: E402

preflight.use_plugins()  # before JAX starts its backends

from experiments import common  # noqa: E402
from tfm import parallel  # noqa: E402
from tfm.train import Trainer  # noqa: E402

EXIT_DOES_NOT_FIT = 3


def experiment_of(config, config_path: str):
    """The module that trains the recipe (its `config.experiment`), which must build it without
    data: `blueprint(config, num_devices)`."""
    name = config.get("experiment")
    try:
        module = importlib.import_module(name) if name else None
    except ModuleNotFoundError:
        module = None
    if not hasattr(module, "blueprint"):
        raise ValueError(f"--config={config_path}: preflight takes the training recipes of experiments with a "
                         f"blueprint (not fine-tuning); this recipe's experiment is {name!r}")
    return module


def check_batch(trainer: Trainer, batch_size: int) -> int:
    """Rows each device holds per pass; ValueError unless the global batch (per microbatch)
    splits evenly over the batch axes."""
    axes = trainer.batch_sharding.spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    devices = math.prod(trainer.mesh.shape[a] for a in axes)
    per_pass = batch_size // trainer.config.microbatches
    if per_pass % devices:
        raise ValueError(f"batch {batch_size} ({per_pass} per microbatch) does not split over the batch axes "
                         f"{'x'.join(axes)} = {devices} devices; use a multiple of {devices}")
    return per_pass // devices


def as_flags(tip: preflight.Tip) -> str:
    """A tip in the command line's terms: `what: --config.KEY=VALUE ...`."""
    return f"{tip.what}: " + " ".join(f"{common.flag_of(field)}={value}" for field, value in tip.settings.items())


def run_preflight(config, config_path: str, target_name: str, *, num_slices: int = 1,
                  with_eval: bool = True, kernels_apart: bool = False, say=print) -> list[dict]:
    """Compiles every batch shape of the recipe for the target; the reports as dicts
    (`kernels_apart`: see `preflight.check_step`)."""
    target = preflight.parse_target(target_name, num_slices)
    module = experiment_of(config, config_path)
    devices = target.devices()
    if num_slices > 1:
        config.mesh.num_slices = num_slices
    plan = module.blueprint(config, len(devices))
    mesh = parallel.make_mesh(plan.train.mesh, devices)
    say(target.describe())
    context = (f" (sequences split over context: context_strategy {plan.model.config.execution.context_strategy})"
               if mesh.shape["context"] > 1 and "context" in parallel.parse_parallelism(plan.train.parallelism) else "")
    say(f"mesh {dict(mesh.shape)}, parallelism {plan.train.parallelism}, "
        f"attention_impl {plan.model.config.execution.attention_impl}{context}, scan_layers {plan.model.config.execution.scan_layers}, "
        f"remat {plan.model.config.execution.remat_policy}, dtype {plan.model.config.execution.dtype}")
    records = []
    for shape_name, batch in plan.batches.items():
        trainer = Trainer(plan.model, plan.task, plan.train, mesh)
        rows = check_batch(trainer, next(iter(batch.values())).shape[0])
        trainer.setup(batch)
        say(f"{shape_name}: batch {next(iter(batch.values())).shape}, {trainer.num_params / 1e6:.1f}M parameters")
        for report in preflight.check_step(trainer, batch, target, with_eval=with_eval,
                                           kernels_apart=kernels_apart):
            for line in preflight.format_report(report, target.chip):
                say("  " + line)
            if not report.fits:
                for tip in preflight.advice(plan.train, plan.model.config, rows):
                    say(f"    to fit: {as_flags(tip)}")
            records.append({"recipe": config_path, "shape": shape_name, "parameters": trainer.num_params,
                            **dataclasses.asdict(report)})
    return records


def main():
    from absl import flags
    from ml_collections import config_flags

    common.define_config_flag()
    flags.DEFINE_string("target", None, "e.g. v5p-8, v5e-256, v6e:4x4, h100-8 (see the module doc)")
    flags.DEFINE_integer("num_slices", 1, "TPU slices (or GPU host groups) joined over DCN")
    flags.DEFINE_bool("eval", True, "also compile the eval step")
    flags.DEFINE_string("json", None, "write the reports to this file as JSON")
    flags.DEFINE_bool("kernels_apart", False, "compile each step with flash kernels twice to report the kernels' "
                      "part of the estimate apart (TPU)")
    flags.mark_flags_as_required(["config", "target"])

    def run(argv):
        del argv
        records = run_preflight(flags.FLAGS.config, config_flags.get_config_filename(flags.FLAGS["config"]),
                                flags.FLAGS.target, num_slices=flags.FLAGS.num_slices,
                                with_eval=flags.FLAGS.eval, kernels_apart=flags.FLAGS.kernels_apart,
                                say=lambda s: print(s, flush=True))
        if flags.FLAGS.json:
            with open(flags.FLAGS.json, "w") as f:
                json.dump(records, f, indent=1, default=str)
        if not all(r["fits"] for r in records):
            print("does not fit: see 'to fit' above")
            sys.exit(EXIT_DOES_NOT_FIT)
        print("fits: every step compiled within the chips' memory")

    common.run_cli(run)


if __name__ == "__main__":
    main()
