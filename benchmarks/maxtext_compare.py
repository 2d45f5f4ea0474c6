"""tfm beside MaxText on the same compile: one model and slice through tfm's preflight and MaxText's
ahead-of-time compile (`train_compile`), compile-only from this CPU; nothing runs.

    python -m benchmarks.maxtext_compare --maxtext=PATH/TO/maxtext                       # Llama-2 7B, v5p-256
    python -m benchmarks.maxtext_compare --maxtext=PATH --target=v5p-512 --remat_policy=full \\
        --config.model.overrides.execution.remat_policy=full --out=cmp_v5p512

tfm's side is `experiments.preflight` on --config (default `experiments/lm/configs/llama2.py:7b`,
`--config.KEY=VALUE` overrides as there) for --target, its train step compiled twice so that the
flash kernels' part of XLA's estimate is apart (`--kernels_apart`). MaxText's side is its own
`train_compile.main` (a checkout at --maxtext: `src/maxtext/...`, or the older `MaxText/` layout),
run in a child process so that its settings (JAX's PRNG, LIBTPU_INIT_ARGS) stay its own, with
`key=value` arguments for the same step: model_name (--model_name, default llama2-7b),
compile_topology = --target, per_device_batch_size = tfm's batch / chips, max_target_length = tfm's
sequence length, remat_policy (--remat_policy, default minimal: it saves the matmul outputs as tfm's
7B recipe does), and any --maxtext_args. The compiled step is taken from its `jit_and_compile`.

For both: memory per chip (XLA's memory analysis: arguments, outputs, temporaries, total), the
collectives by kind and what the all-reduces do (`tfm.preflight.read_hlo`, `all_reduce_forms`),
the Pallas kernel calls and how many carry a cost estimate, and XLA's cost-model step (its
`optimal_seconds` x the loop factor: matmul FLOPs unrolled / each scan body once, read from each
step's jaxpr alike), with the ratio tfm / MaxText. MaxText's splash kernel carries no cost estimate,
so XLA scores it at 0 s: the like-for-like row sets tfm's step without its kernels' part beside it.
Writes --out/report.md (the table) and --out/report.json. Without --maxtext, or when MaxText cannot
be imported from it, one line says so and what to pass, and tfm's side is still reported (exit 0).
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices; nothing runs on them

from tfm import preflight  # noqa: E402

preflight.use_plugins()  # before JAX starts its backends

import jax  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402

from experiments import common  # noqa: E402
from experiments import preflight as tfm_preflight  # noqa: E402

# The layouts of a MaxText checkout: (folders put on sys.path, train_compile's module, its base config)
LAYOUTS = ((("src",), "maxtext.trainers.pre_train.train_compile", "src/maxtext/configs/base.yml"),
           (("", "MaxText"), "MaxText.train_compile", "MaxText/configs/base.yml"))
HOW = ("pass --maxtext=PATH, a MaxText checkout (git clone https://github.com/AI-Hypercomputer/maxtext) whose "
       "requirements are installed in this environment")
SPLASH = "MaxText's splash kernel carries no cost estimate: XLA's cost model scores it at 0 s"
FAILED = "failed: MaxText's train_compile did not compile the step"


# ---------------------------------------------------------------------------- MaxText's side


def layout(checkout: Optional[str]) -> Optional[tuple]:
    """The entry of LAYOUTS whose base config the checkout at `checkout` has, or None."""
    return next((entry for entry in LAYOUTS if checkout and os.path.isfile(os.path.join(checkout, entry[2]))), None)


def base_config(checkout: Optional[str]) -> str:
    """MaxText's base.yml in the checkout (where the first layout has it, when there is none)."""
    return os.path.join(checkout or "", (layout(checkout) or LAYOUTS[0])[2])


def find_train_compile(checkout: str):
    """MaxText's train_compile module from the checkout at `checkout` (its folders put on sys.path);
    ImportError with the reason: no checkout there, or a module that fails to import."""
    found = layout(checkout)
    if found is None:
        raise ImportError(f"no MaxText checkout at {checkout} (neither of {', '.join(c for _, _, c in LAYOUTS)})")
    paths, module, _ = found
    sys.path[:0] = [os.path.join(checkout, p) for p in paths]
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to import is the reason to skip
        raise ImportError(f"{module} from {checkout} does not import: {type(e).__name__}: {e}") from e


def maxtext_argv(base_yml: str, *, target: str, batch_size: int, chips: int, seq_len: int, model_name: str,
                 remat_policy: str, output_dir: str, extra=()) -> list[str]:
    """train_compile's argv for tfm's step: [program, base.yml, key=value, ...]; per_device_batch_size is
    the global batch (sequences) over the chips (MaxText's devices: one per v5p chip)."""
    return ["train_compile", base_yml, f"model_name={model_name}", f"compile_topology={target}",
            "compile_topology_num_slices=1", f"per_device_batch_size={batch_size / chips:g}",
            f"max_target_length={seq_len}", f"remat_policy={remat_policy}", f"base_output_directory={output_dir}",
            *extra]


def compile_maxtext(module, argv: list[str]):
    """(compiled train step, loop factor) of `module.main(argv)`: its `jit_and_compile` is wrapped to keep
    what it returns and to trace the same function (under the same mesh and logical-axis rules) for the
    loop factor (`tfm.preflight.loop_factor`)."""
    original, kept = module.jit_and_compile, {}
    signature = inspect.signature(original)

    def keep(*args, **kwargs):
        kept["compiled"] = original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        rules = nn_partitioning.axis_rules(a["config"].logical_axis_rules)  # theirs is entered once, by them
        with jax.set_mesh(a["mesh"]), a["mesh"], rules:
            traced = jax.jit(a["func"], static_argnums=a["static_argnums"]).trace(*a["func_input_args"],
                                                                                  **a["func_input_kwargs"])
        kept["factor"] = preflight.loop_factor(traced.jaxpr.jaxpr)
        return kept["compiled"]

    module.jit_and_compile = keep
    try:
        module.main(argv)
    finally:
        module.jit_and_compile = original
    return kept["compiled"], kept["factor"]


def read_compiled(text: str, memory, cost: dict, factor: float) -> dict:
    """One side's figures from a compiled step: its HLO `text`, `memory_analysis()` (bytes per chip),
    `cost_analysis()` dict (`optimal_seconds`: XLA's cost model, a loop body once) and loop factor.
    Bytes per chip, seconds per step; the same keys as `tfm_figures`."""
    collectives, kernels, _ = preflight.read_hlo(text)
    seconds = cost.get("optimal_seconds")
    return {"argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
            "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
            "total_bytes": preflight.memory_bytes(memory), "collectives": collectives,
            "all_reduce_forms": preflight.tally_forms(preflight.all_reduce_forms(text)),
            "kernel_calls": len(kernels), "kernels_with_cost_estimate": sum(k["cost_estimate"] for k in kernels),
            "loop_factor": factor, "cost_model_seconds": seconds, "time_by_op": preflight.time_by_op(text, top=12),
            "estimate_seconds": seconds * factor if seconds else None}


def maxtext_figures(module, argv: list[str]) -> dict:
    """MaxText's side, compiled in this process (the child's work) by train_compile `module`:
    `read_compiled` of its step, or {"error"} when the compiler refused it for memory."""
    try:
        compiled, factor = compile_maxtext(module, argv)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the finding
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        return {"error": " ".join(str(e).split())[:400]}
    figures = read_compiled(compiled.as_text(), compiled.memory_analysis(), preflight.cost_analysis(compiled), factor)
    # kernels without a cost estimate are scored at 0 s: then the estimate is already one without them
    figures["estimate_seconds_without_kernels"] = (None if figures["kernels_with_cost_estimate"]
                                                   else figures["estimate_seconds"])
    return figures


def run_maxtext(checkout: Optional[str], argv: list[str], out_dir: str) -> tuple[Optional[dict], str]:
    """(MaxText's figures, "") from a child process (`--maxtext_worker`), or (None, why not): no
    --maxtext, no checkout there or one that does not import, or (starting with FAILED) a compile
    that failed otherwise than for memory."""
    if not checkout:
        return None, f"not compared (no --maxtext given); {HOW}"
    answer_path = os.path.join(out_dir, "maxtext_side.json")
    if os.path.exists(answer_path):
        os.remove(answer_path)
    with open(os.path.join(out_dir, "maxtext_request.json"), "w") as f:
        json.dump({"checkout": os.path.abspath(checkout), "argv": argv}, f)
    child = subprocess.run([sys.executable, "-m", "benchmarks.maxtext_compare", f"--maxtext_worker={out_dir}"],
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if child.returncode or not os.path.exists(answer_path):
        return None, f"{FAILED} (exit {child.returncode}; its output above)"
    with open(answer_path) as f:
        answer = json.load(f)
    if "skipped" in answer:
        return None, f"not compared ({answer['skipped']}); {HOW}"
    return answer["figures"], ""


def worker(out_dir: str) -> None:
    """The child: MaxText's side for out_dir/maxtext_request.json, written to out_dir/maxtext_side.json
    ({"figures"}, or {"skipped": reason} when MaxText does not import)."""
    with open(os.path.join(out_dir, "maxtext_request.json")) as f:
        request = json.load(f)
    try:
        module = find_train_compile(request["checkout"])
    except ImportError as e:
        answer = {"skipped": str(e)}
    else:
        answer = {"figures": maxtext_figures(module, request["argv"])}
    with open(os.path.join(out_dir, "maxtext_side.json"), "w") as f:
        json.dump(answer, f)


# ---------------------------------------------------------------------------- tfm's side and the table


def tfm_figures(record: dict) -> dict:
    """tfm's side from a preflight record of its train step (`experiments.preflight.run_preflight`),
    with `read_compiled`'s keys."""
    keys = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes", "collectives",
            "all_reduce_forms", "cost_model_seconds", "estimate_seconds", "estimate_seconds_without_kernels",
            "kernel_seconds", "error", "time_by_op")
    figures = {k: record[k] for k in keys}
    figures["kernel_calls"] = len(record["kernels"])
    figures["kernels_with_cost_estimate"] = sum(k["cost_estimate"] for k in record["kernels"])
    seconds = record["cost_model_seconds"]
    figures["loop_factor"] = record["estimate_seconds"] / seconds if seconds else None
    return figures


def _gib(n) -> str:
    return "—" if n is None else preflight.format_bytes(n)


def _ms(seconds) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.4g} ms"


def _times(factor) -> str:
    return "—" if factor is None else f"{factor:.2f}"


def _collective(entry: Optional[dict]) -> str:
    return f"x{entry['count']} ({_gib(entry['bytes'])})" if entry else "none"


def _calls(side: dict) -> str:
    return f"{side['kernel_calls']} ({side['kernels_with_cost_estimate']})"


# (label, key, format, with the ratio tfm / MaxText)
ROWS = (("memory: arguments", "argument_bytes", _gib, True), ("memory: outputs", "output_bytes", _gib, True),
        ("memory: temporaries", "temp_bytes", _gib, True),
        ("memory: total (arguments + outputs - donated + temporaries)", "total_bytes", _gib, True),
        ("step without the attention kernels' time", "estimate_seconds_without_kernels", _ms, True),
        ("step with the kernels that carry a cost estimate", "estimate_seconds", _ms, True),
        ("flash kernels' part (compiled again without their estimates)", "kernel_seconds", _ms, False),
        ("loop factor (matmul FLOPs unrolled / each scan body once)", "loop_factor", _times, False))


def table(tfm: dict, maxtext: Optional[dict]) -> list[str]:
    """The side by side as markdown lines, per chip: tfm | MaxText | tfm / MaxText; MaxText's column
    is "—" where it was not compiled."""
    compared = bool(maxtext) and not maxtext.get("error")

    def row(label, read, fmt, ratio=False):
        a, b = read(tfm), read(maxtext) if compared else None
        shown = f"{a / b:.3f}" if ratio and a is not None and b else ""
        return f"| {label} | {fmt(a)} | {fmt(b) if compared else '—'} | {shown} |"

    lines = ["| per chip | tfm | MaxText | tfm / MaxText |", "|---|---|---|---|"]
    lines += [row(label, lambda side, key=key: side.get(key), fmt, ratio) for label, key, fmt, ratio in ROWS]
    kinds = sorted(set(tfm["collectives"]) | set(maxtext["collectives"] if compared else ()))
    lines += [row(f"{kind} (loop bodies once)", lambda side, k=kind: side["collectives"].get(k), _collective)
              for kind in kinds]
    lines += [row(f"all-reduced arrays that {form}", lambda side, f=form: side["all_reduce_forms"].get(f),
                  _collective) for form in ("gather", "scatter", "sum")]
    lines.append(row("Pallas kernel calls (with a cost estimate)", lambda side: side, _calls))
    return lines


def report(tfm: dict, maxtext: Optional[dict], setup: dict) -> str:
    """The markdown report: what was compiled, the table, and how to read its step rows."""
    lines = [f"# tfm beside MaxText: {setup['config']} on {setup['target']}", "", f"- tfm: {setup['tfm']}",
             f"- MaxText: {setup['maxtext']}", ""]
    lines += table(tfm, maxtext)
    lines += ["", f"{SPLASH} (the last row counts, from each compiled program, the kernel calls that carry one); "
              "tfm's flash kernels carry theirs, so the like-for-like step is tfm's without its kernels' part (the "
              "estimate of the same step compiled again without the kernels' cost estimates) beside MaxText's. "
              "Estimates: XLA's TPU cost model (`optimal_seconds`, a loop body once) x the loop factor."]
    lines += [f"{name} did not compile: {side['error']}" for name, side in (("tfm", tfm), ("MaxText", maxtext))
              if side and side.get("error")]
    lines += ["", "Where each step's estimated cycles go (`tfm.preflight.time_by_op`: XLA's cycles per fusion, "
              "loop bodies x their trip counts; shares, not the step estimate):"]
    lines += [f"- {name}: " + ", ".join(f"{label} {share:.1%}" for label, share in side["time_by_op"])
              for name, side in (("tfm", tfm), ("MaxText", maxtext)) if side and side.get("time_by_op")]
    return "\n".join(lines) + "\n"


def compare(config, config_path: str, target_name: str, *, checkout: Optional[str], model_name: str,
            remat_policy: str, extra=(), out_dir: str, say=print) -> dict:
    """Both sides of one train step; writes out_dir/report.md and report.json, returns the JSON's dict.
    ChildProcessError (after writing) when MaxText's compile failed otherwise than for memory."""
    os.makedirs(out_dir, exist_ok=True)
    records = tfm_preflight.run_preflight(config, config_path, target_name, with_eval=False, kernels_apart=True,
                                          say=say)
    tfm = tfm_figures(next(r for r in records if r["step"] == "train"))
    argv = maxtext_argv(base_config(checkout), target=target_name, batch_size=config.batch_size,
                        chips=preflight.parse_target(target_name).chips, seq_len=config.seq_len,
                        model_name=model_name, remat_policy=remat_policy,
                        output_dir=os.path.abspath(os.path.join(out_dir, "maxtext_output")), extra=extra)
    maxtext, why_not = run_maxtext(checkout, argv, out_dir)
    if why_not:
        say(f"MaxText: {why_not}")
    setup = {"config": config_path, "target": target_name,
             "tfm": f"experiments.preflight --kernels_apart, batch {config.batch_size} x {config.seq_len} tokens",
             "maxtext": why_not or "train_compile " + " ".join(argv[2:])}
    ratio = lambda key: tfm[key] / maxtext[key] if maxtext and tfm.get(key) and maxtext.get(key) else None
    result = {**setup, "maxtext_argv": argv, "tfm_figures": tfm, "maxtext_figures": maxtext, "note": SPLASH,
              "step_ratio_without_kernels": ratio("estimate_seconds_without_kernels"),
              "memory_ratio": ratio("total_bytes")}
    text = report(tfm, maxtext, setup)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(result, f, indent=1)
    say(text)
    if why_not.startswith(FAILED):
        raise ChildProcessError(f"MaxText {why_not}; tfm's side is in {out_dir}/report.md")
    return result


def main():
    from absl import flags
    from ml_collections import config_flags

    common.define_config_flag("experiments/lm/configs/llama2.py:7b")
    flags.DEFINE_string("target", "v5p-256", "a TPU slice named as MaxText's compile_topology names it")
    flags.DEFINE_string("maxtext", None, "a MaxText checkout; without it only tfm's side is reported")
    flags.DEFINE_string("model_name", "llama2-7b", "MaxText's model_name for the same model")
    flags.DEFINE_string("remat_policy", "minimal", "MaxText's remat_policy")
    flags.DEFINE_multi_string("maxtext_args", [], "more key=value arguments for MaxText's train_compile")
    flags.DEFINE_string("out", "maxtext_compare_out", "folder for report.md and report.json")
    flags.DEFINE_string("maxtext_worker", None, "(internal) compile MaxText's side for the request in this folder")

    def run(argv):
        del argv
        if flags.FLAGS.maxtext_worker:
            return worker(flags.FLAGS.maxtext_worker)
        bad = [a for a in flags.FLAGS.maxtext_args if "=" not in a]
        if bad:
            raise ValueError(f"--maxtext_args={bad[0]!r}: MaxText takes key=value, e.g. --maxtext_args=attention=flash")
        compare(flags.FLAGS.config, config_flags.get_config_filename(flags.FLAGS["config"]), flags.FLAGS.target,
                checkout=flags.FLAGS.maxtext, model_name=flags.FLAGS.model_name,
                remat_policy=flags.FLAGS.remat_policy, extra=flags.FLAGS.maxtext_args, out_dir=flags.FLAGS.out,
                say=lambda s: print(s, flush=True))

    common.run_cli(run)


if __name__ == "__main__":
    main()
