"""benchmarks/decode.py: the inputs both frameworks get, and the --smoke run that `make bench` does; benchmarks/decode_context.py --smoke."""
import re

import numpy as np

from benchmarks import decode as bench


def test_sources_lengths_and_padding():
    ids = bench.sources(16, 10, vocab=50)
    lengths = (ids != bench.PAD).sum(1)
    assert ids.shape == (16, 10) and lengths.min() >= 5 and lengths.max() <= 10
    assert (ids[np.arange(16), lengths - 1] == bench.EOS).all()
    assert ((ids[:, :-1] == bench.PAD) <= (ids[:, 1:] == bench.PAD)).all()  # padding only at the end
    np.testing.assert_array_equal(ids, bench.sources(16, 10, vocab=50))


def test_output_lengths_stop_at_first_eos():
    tokens = np.array([[5, 6, bench.EOS, 0], [5, 6, 7, 8], [bench.EOS, 0, 0, 0], [5, 0, 0, 0]])
    np.testing.assert_array_equal(bench._lengths(tokens), [3, 4, 1, 1])


def test_smoke_run_prints_both_impls_and_ratios(capsys):
    bench.main(["--smoke"])
    out = capsys.readouterr().out
    for beam in (1, 4):  # the smoke run's one batch size: 4 sentences
        assert re.search(rf"^tfm +4 +{beam} +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M)
        assert re.search(rf"^hf +4 +{beam} +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M)
        assert re.search(rf"^ratio tfm/hf, batch 4, beam {beam}: [\d.]+x", out, re.M)


def test_decode_context_smoke_prints_every_model_at_every_context(capsys, tmp_path):
    """benchmarks/decode_context.py --smoke: one row per model with its time at the one context, and the plot."""
    from benchmarks import decode_context
    decode_context.main(["--smoke", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    for name in decode_context.MIXERS:
        assert re.search(rf"^\| {re.escape(name)} \| [\d.]+M \| [\d.]+ ms \| [\d.]+ MiB \|$", out, re.M), out
    assert (tmp_path / "p.png").stat().st_size > 0
