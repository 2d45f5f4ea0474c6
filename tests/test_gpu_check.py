"""benchmarks/gpu_check.py: the --smoke run end to end on CPU, and the parts that decide
pass or fail (the comparison) and the proposed `auto` rules."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import xla_env

from benchmarks import gpu_check

SECTIONS = ["## 1. correctness", "## 2. attention", "## 3. train", "## 4. decode", "## 5. auto"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(completed process, report text, output directory) of one --smoke run."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = xla_env.subprocess_env()  # one CPU device, as one GPU
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    return proc, report, out


def section(report: str, number: int) -> str:
    start = report.index(SECTIONS[number - 1])
    end = report.index(SECTIONS[number]) if number < len(SECTIONS) else len(report)
    return report[start:end]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in text, as stripped cells."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows if r[0] not in ("case", "pass", "model", "batch")]


def test_smoke_run_exits_zero_with_every_section(smoke):
    proc, report, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [s for s in SECTIONS if s in report] == SECTIONS
    assert "- command: `python -m benchmarks.gpu_check --smoke" in report
    assert (out / "attention.png").stat().st_size > 10_000


def test_xla_and_pallas_are_within_tolerance_in_every_case(smoke):
    _, report, _ = smoke
    rows = [r for r in table_rows(section(report, 1)) if r[1] in ("xla", "pallas")]
    cases = len(gpu_check.correctness_cases(smoke=True))
    assert len({r[0] for r in rows}) == cases == 7 and len(rows) == cases * 2 * 2  # cases x impls x dtypes
    for case, impl, dtype, *errors, tolerance, status in rows:
        assert status == "ok", (case, impl, dtype, status)
        assert all(float(e) < float(tolerance) == gpu_check.TOLERANCE[dtype] for e in errors), (case, impl, errors)


def test_unavailable_cases_say_why(smoke):
    _, report, _ = smoke
    cudnn = [r for r in table_rows(section(report, 1)) if r[1] == "cudnn"]
    assert cudnn and all(r[-1] == "unavailable: cuDNN needs a GPU (JAX backend is cpu)" for r in cudnn)
    cells = [c for r in table_rows(section(report, 2)) for c in r[6:]]
    hopper = [r for r in table_rows(section(report, 1)) if r[1] == "hopper"]
    assert hopper and all(r[-1] == "unavailable: the Hopper kernel needs an H100/H200 (device: cpu)" for r in hopper)
    impls = len(gpu_check.THROUGHPUT_IMPLS)
    assert sum(c.startswith("unavailable: torch") and "has no CUDA device" in c for c in cells) == 2 * len(cells) // impls
    assert all(re.fullmatch(r"[\d.]+|unavailable: \S.*", c) for c in cells), cells
    train = table_rows(section(report, 3))
    assert any(r[2] == "torch compile" and r[-1].startswith("unavailable: torch.compile") for r in train)
    # the smoke run times each tfm impl on one model (gpu_check.SMOKE_TFM_MODEL), torch eager on both
    ran = [r for r in train if not r[-1].startswith(("unavailable", "skipped"))]
    assert sorted((r[0], r[2]) for r in ran) == [("bert_dropout", "tfm pallas"), ("bert_dropout", "torch eager"),
                                                 ("gpt2", "tfm xla"), ("gpt2", "torch eager")], train
    assert sorted((r[0], r[2], r[-1]) for r in train if r[-1].startswith("skipped")) == [
        ("bert_dropout", "tfm xla", "skipped: the smoke run times tfm xla on gpt2 only"),
        ("gpt2", "tfm pallas", "skipped: the smoke run times tfm pallas on bert_dropout only")], train
    assert all(re.fullmatch(r"[\d.]+", r[3]) for r in ran)
    # memory: XLA's compiled figure for tfm's steps (a positive number); the CPU device keeps no statistics
    assert all(re.fullmatch(r"[\d.e-]+ / n/a", r[6]) and float(r[6].split()[0]) > 0 for r in ran if r[2].startswith("tfm")), ran
    assert all(r[6] == "— / n/a" for r in ran if r[2].startswith("torch")), ran


def test_decode_and_auto_sections_have_figures(smoke):
    _, report, _ = smoke
    decode = table_rows(section(report, 4))
    assert {r[1] for r in decode} == {"1", "4"} and all(float(r[2]) > 0 and float(r[3]) > 0 for r in decode)
    assert "beam 4 at batch 32: not measured." in section(report, 4)  # the smoke run's batch is 2
    assert re.search(r"^cpu, causal, H 64: L 128: (pallas|xla)$", section(report, 5), re.M)


def test_compare_names_what_is_off():
    rng = np.random.default_rng(0)
    ref = {name: rng.normal(size=(2, 8, 4, 16)).astype(np.float32) for name in ("o", "dq", "dk", "dv")}
    errors, problems = gpu_check.compare(dict(ref), ref, 1e-2)
    assert problems == [] and max(errors.values()) == 0.0
    wrong = dict(ref, dk=ref["dk"] * 1.05)  # a backend 5% off in one gradient
    errors, problems = gpu_check.compare(wrong, ref, 1e-2)
    assert len(problems) == 1 and problems[0].startswith("dk ") and errors["dk"] > 1e-2
    nan = dict(ref, o=np.where(np.arange(16) == 3, np.nan, ref["o"]))
    assert gpu_check.compare(nan, ref, 1e-2)[1] == ["NaN/inf in o"]
    assert gpu_check.compare(ref, nan, 1e-2)[1] == ["NaN/inf in the reference's o"]  # never a silent pass


def test_proposed_rules_group_lengths_by_winner():
    best = {("fwd+bwd", True, 64, L): (impl, 1.0) for L, impl in
            [(1024, "cudnn"), (2048, "cudnn"), (4096, "pallas"), (8192, "pallas")]}
    best[("fwd", True, 64, 1024)] = ("xla", 1.0)  # forward-only winners do not make rules
    rules = gpu_check.proposed_rules(best)
    assert rules[0].endswith("causal, H 64: L 1024-2048: cudnn, L 4096-8192: pallas")
    assert len(rules) == 3 and "soft-cap" in rules[1] and "segment ids" in rules[2]
