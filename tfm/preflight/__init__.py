"""Preflight: compile a training run for TPU slices or NVIDIA GPUs from any (CPU) machine.

    target = parse_target("v5p-8")                      # 4 compile-only v5p chips
    trainer = Trainer(model, task, config, mesh=make_mesh(config.mesh, target.devices()))
    trainer.setup(example_batch)                       # abstract: nothing runs on the mesh
    for report in check_step(trainer, global_batch_spec, target):
        print("\n".join(format_report(report, target.chip)))

Run with JAX_PLATFORMS=cpu and the compile-only plugins on the path (`use_plugins()` before
JAX starts). The command that reads experiment recipes is `experiments.preflight`; `advice` names
what would make a step fit by tfm's own fields (`Tip`), which that command renders as its flags.
"""
import collections

from tfm.preflight.analysis import (StepReport, Tip, advice, all_reduce_forms, check_step, cost_analysis, dot_flops,
                                   has_flash_kernels, loop_factor, memory_bytes, model_flops, read_hlo, tally_forms,
                                   time_by_op, unexpected_all_reduces)
from tfm.preflight.targets import CHIPS, GiB, Target, parse_target, require_plugin, use_plugins, valid_targets


def format_bytes(n: float) -> str:
    """Bytes as "1.23 GiB", or "45.6 MiB" below a tenth of a GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def _kernels_part(r: StepReport) -> list[str]:
    """The line on the flash kernels' part of the estimate (`check_step(kernels_apart=True)`), if any."""
    flash = has_flash_kernels(r.kernels)
    if r.kernel_seconds is not None and flash:
        without = r.estimate_seconds_without_kernels
        return [f"  flash kernels' part of the estimate: {r.kernel_seconds * 1e3:.2f} ms "
                f"({r.kernel_seconds / r.estimate_seconds:.1%}); without them {without * 1e3:.2f} ms (XLA's cost "
                "model of the step compiled again without the kernels' cost estimates, the same loop factor; the "
                "compile time above counts both compiles)"]
    if r.estimate_seconds and flash:
        return ["  flash kernels' part of the estimate: not taken apart (kernels_apart compiles the step a second "
                "time without their cost estimates)"]
    return []


def format_report(r: StepReport, chip) -> list[str]:
    """The report as lines of text for a step on `chip` (estimates named as such)."""
    lines = [f"{r.step} step on {r.target} ({r.chips} chips): compiled in {r.compile_seconds:.1f} s"]
    if r.error:
        lines.append(f"  memory: DOES NOT FIT - the compiler refused: {r.error}")
        return lines
    verdict = "fits" if r.fits else "DOES NOT FIT"
    held = "params+optimizer" if r.step == "train" else "params"
    b = format_bytes
    lines.append(f"  memory per chip: {held} {b(r.state_bytes)}, arguments {b(r.argument_bytes)}, "
                 f"outputs {b(r.output_bytes)} ({b(r.alias_bytes)} donated), temporaries {b(r.temp_bytes)}; "
                 f"total {b(r.total_bytes)} of {b(r.hbm_bytes)} HBM ({r.total_bytes / r.hbm_bytes:.0%}): {verdict}")
    counted = "forward + backward: 3 x the forward's matmuls" if r.step == "train" else "the forward's matmuls"
    lines.append(f"  model FLOPs per step: {r.model_flops:.4g} ({counted})"
                 + (f"; XLA counts {r.xla_flops:.4g} per chip" if r.xla_flops else ""))
    if r.xla_flops and r.xla_bytes and r.cost_model_seconds:
        lines.append(f"  roofline per chip: matmul-rate time {r.xla_flops / chip.peak_flops * 1e3:.2f} ms, HBM time "
                     f"{r.xla_bytes / chip.hbm_bandwidth * 1e3:.2f} ms ({r.xla_bytes / GiB:.1f} GiB moved), "
                     f"against the cost model's {r.cost_model_seconds * 1e3:.2f} ms")
    if r.estimate_seconds:
        lines.append(f"  estimated step time {r.estimate_seconds * 1e3:.2f} ms, MFU {r.mfu:.1%} "
                     f"(an estimate: {r.estimate_note})")
    else:
        lines.append(f"  estimated step time: {r.estimate_note}")
    lines.extend(_kernels_part(r))
    if r.time_by_op:
        lines.append("  estimated time by op (XLA's cycles per fusion, loop bodies x their trip counts; collectives "
                     "apart): " + ", ".join(f"{label} {share:.1%}" for label, share in r.time_by_op))
    if r.collectives:
        lines.append("  collectives (loop bodies once): " + ", ".join(
            f"{k} x{v['count']} ({format_bytes(v['bytes'])})" for k, v in sorted(r.collectives.items())))
    else:
        lines.append("  collectives: none")
    if set(r.all_reduce_forms) - {"sum"}:  # XLA TPU writes some gathers and scatters as all-reduces
        names = {"gather": "all-gathers", "scatter": "reduce-scatters", "sum": "sums"}
        lines.append("  all-reduced arrays by what they do: " + ", ".join(
            f"{names[k]} x{v['count']} ({format_bytes(v['bytes'])})" for k, v in sorted(r.all_reduce_forms.items()))
            + " (an all-gather or reduce-scatter written as an all-reduce)")
    if r.unexpected:
        lines.append(f"  UNEXPECTED under fsdp: {len(r.unexpected)} weight- or activation-sized arrays summed whole "
                     "(the plan gathers weights and reduce-scatters gradients): " + "; ".join(
                         f"{u['array']} over {u['group_size']} chips ({u['op_name'][-60:] or 'no op name'})"
                         for u in r.unexpected[:5]))
    kernels = collections.Counter((k["backend"], k["name"], k["result"], tuple(k["operands"][:2])) for k in r.kernels)
    if kernels:
        for (backend, name, result, operands), n in kernels.items():
            lines.append(f"  kernel {backend} {name} x{n}: per-device operands {', '.join(operands)} "
                         f"-> {result}")
    else:
        lines.append("  kernels: none (XLA's own ops: attention impl xla or chunked)")
    if not r.fits:
        lines.append("  largest arrays: " + "; ".join(f"{format_bytes(b)} {s} ({op})" for b, s, op in r.largest))
    return lines


__all__ = ["CHIPS", "GiB", "StepReport", "Target", "Tip", "advice", "all_reduce_forms", "check_step", "cost_analysis",
           "dot_flops", "format_bytes", "format_report", "has_flash_kernels", "loop_factor", "memory_bytes",
           "model_flops", "parse_target", "read_hlo", "require_plugin", "tally_forms", "time_by_op",
           "unexpected_all_reduces", "use_plugins", "valid_targets"]
