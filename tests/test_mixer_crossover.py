"""benchmarks.mixer_crossover: the crossover against closed-form power laws, the compiled program's byte
count of a scan body against a hand count, the compile-only estimate of the flash kernels against their
matrix products counted by hand, and the measured command end to end on CPU (the GPU command's smoke run)."""
import json
import math

import pytest

from benchmarks import mixer_crossover as mx
from benchmarks import step_profile
from tfm.preflight.targets import CHIPS, parse_target


def test_crossover_of_power_laws_is_exact():
    """attention c L^2, a mixer d L: equal at L* = d / c; the log-log interpolation is exact there."""
    lengths = [1024, 2048, 4096, 8192, 16384]
    attention = {L: 1e-6 * L * L for L in lengths}
    mixer = {L: 3e-3 * L for L in lengths}  # L* = 3000
    L, text = mx.crossover(mixer, attention)
    assert L == pytest.approx(3000, rel=1e-12) and "2,048" in text and "4,096" in text
    assert mx.crossover({L: 1e-9 * L for L in lengths}, attention)[0] is None  # faster everywhere
    assert "up to L 16,384" in mx.crossover({L: 1e9 for L in lengths}, attention)[1]  # never
    # faster at 1k, slower at 2k, faster from 4k on: the crossover is the last one, between 2k and 4k
    wobbly = {**mixer, 1024: 1e-7}
    assert mx.crossover(wobbly, attention)[0] == pytest.approx(3000, rel=1e-12)


def test_estimate_is_the_larger_roofline_term():
    chip = CHIPS["h100"]
    assert mx.estimate(chip.peak_flops, 0.0, chip) == (1.0, "compute")
    assert mx.estimate(1.0, 2 * chip.hbm_bandwidth, chip) == (2.0, "memory")


# A scan of 4 steps: one fusion reads step i of xs [4, 8, 16] through a dynamic slice, another writes its
# [8, 16] result into ys in place; the counter adds 1 to i.
SCAN_HLO = """HloModule scan

%read (p.0: f32[4,8,16], p.1: s32[]) -> f32[8,16] {
  %p.0 = f32[4,8,16]{2,1,0} parameter(0)
  %p.1 = s32[] parameter(1)
  %z.0 = s32[] constant(0)
  %sl.0 = f32[1,8,16]{2,1,0} dynamic-slice(%p.0, %p.1, %z.0, %z.0), dynamic_slice_sizes={1,8,16}
  %r.0 = f32[8,16]{1,0} reshape(%sl.0)
  ROOT %e.0 = f32[8,16]{1,0} exponential(%r.0)
}

%write (p.2: f32[4,8,16], p.3: f32[8,16], p.4: s32[]) -> f32[4,8,16] {
  %p.2 = f32[4,8,16]{2,1,0} parameter(0)
  %p.3 = f32[8,16]{1,0} parameter(1)
  %p.4 = s32[] parameter(2)
  %z.1 = s32[] constant(0)
  %u.0 = f32[1,8,16]{2,1,0} reshape(%p.3)
  ROOT %d.0 = f32[4,8,16]{2,1,0} dynamic-update-slice(%p.2, %u.0, %p.4, %z.1, %z.1)
}

%body (p.5: (s32[], f32[4,8,16], f32[4,8,16])) -> (s32[], f32[4,8,16], f32[4,8,16]) {
  %p.5 = (s32[], f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0}) parameter(0)
  %i.0 = s32[] get-tuple-element(%p.5), index=0
  %xs.0 = f32[4,8,16]{2,1,0} get-tuple-element(%p.5), index=1
  %ys.0 = f32[4,8,16]{2,1,0} get-tuple-element(%p.5), index=2
  %step.0 = f32[8,16]{1,0} fusion(%xs.0, %i.0), kind=kLoop, calls=%read
  %ys.1 = f32[4,8,16]{2,1,0} fusion(%ys.0, %step.0, %i.0), kind=kLoop, calls=%write
  %one.0 = s32[] constant(1)
  %i.1 = s32[] add(%i.0, %one.0)
  ROOT %t.0 = (s32[], f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0}) tuple(%i.1, %xs.0, %ys.1)
}

%cond (p.6: (s32[], f32[4,8,16], f32[4,8,16])) -> pred[] {
  %p.6 = (s32[], f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.6), index=0
  %n.0 = s32[] constant(4)
  ROOT %lt.0 = pred[] compare(%i.2, %n.0), direction=LT
}

ENTRY %main (xs: f32[4,8,16], ys: f32[4,8,16]) -> (s32[], f32[4,8,16], f32[4,8,16]) {
  %xs = f32[4,8,16]{2,1,0} parameter(0)
  %ys = f32[4,8,16]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0}) tuple(%zero, %xs, %ys)
  ROOT %loop = (s32[], f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_breakdown_counts_a_scan_body_by_its_slices():
    """Per step: the read reads one [8, 16] slice and i, writes [8, 16]; the write reads the update and
    i and writes the update's bytes in place; the counter reads 2 and writes 1 s32. Four steps: 4 x 2,068
    bytes (counted whole, the stacked arrays alone would be 4 x 6,168 more)."""
    kernels, _ = step_profile.breakdown(SCAN_HLO)
    step = 8 * 16 * 4
    assert [(k.name, k.bytes, k.count) for k in kernels] == [
        ("step.0", 2 * step + 4, 4), ("ys.1", 2 * step + 4, 4), ("i.1", 12, 4)]
    assert sum(k.bytes * k.count for k in kernels) == 4 * 2068


def test_compile_only_flash_rows_count_the_kernels_flops(tmp_path):
    """tfm's Triton flash kernels compiled for an H100 keep no cost estimate in the program: the
    estimate's FLOPs are their matrix products counted by hand (nothing else in the program multiplies)."""
    try:
        parse_target("h100-1").devices()
    except ValueError as error:  # the CUDA compile-only plugin is missing (make compile-plugins)
        pytest.skip(str(error))
    mx.main(["--compile-only", "h100-1", "--smoke", "--lengths", "32", "--impls", "tfm pallas", "--passes",
             "fwd+bwd", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["pass"], r["L"], r["B"]) for r in rows] == [("fwd+bwd", 32, 2)]
    for r in rows:
        N, H = 64 // 16, 16
        # one visible 32 x 32 tile per head (the causal diagonal tile whole), 2 + 3 + 4 matmuls in the
        # forward, dq and dk/dv kernels, over the head dim the GPU kernels pad 16 to (64)
        assert r["flops"] == 2 * (2 + 3 + 4) * (2 * N * 32 * 32) * 64, r
        assert r["bytes"] >= 4 * 2 * 32 * N * H * 2  # q, k, v read and o written at least once
        chip = CHIPS["h100"]
        assert r["ms"] == pytest.approx(1e3 * max(r["flops"] / chip.peak_flops, r["bytes"] / chip.hbm_bandwidth))
        assert r["xla_flops"] is None and r["temp"] >= 0
    assert "estimated ms" in (tmp_path / "report.md").read_text()


def test_smoke_run_writes_rows_report_and_plot(tmp_path):
    """The GPU command's path on CPU: a JAX attention and a JAX mixer timed, flash-linear-attention
    reported unavailable (no CUDA), rows as they finish, the report and the plot."""
    mx.main(["--smoke", "--lengths", "32", "--impls", "tfm xla,ssd chunked,fla ssd", "--passes", "fwd+bwd",
             "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["tfm xla", "ssd chunked", "fla ssd"]
    for r in rows:
        if r["impl"] == "fla ssd":
            assert r["status"].startswith("unavailable") and r["ms"] is None
        else:
            assert r["ms"] > 0 and math.isfinite(r["ms"]) and r["peak"] > 0, r
    text = (tmp_path / "report.md").read_text()
    assert "- ssd chunked: " in text and "| 32 | 2 |" in text
    assert (tmp_path / "mixer_crossover.png").stat().st_size > 0


def test_bad_arguments_fail_in_one_line(capsys):
    with pytest.raises(SystemExit):
        mx.main(["--impls", "tfm flash"])
    assert "--impls: unknown ['tfm flash']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mx.main(["--passes", "bwd"])
    assert "--passes 'bwd': choose from fwd, fwd+bwd" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mx.main(["--width", "100"])
    assert "--width 100 is not a multiple of the head dim 128" in capsys.readouterr().err
