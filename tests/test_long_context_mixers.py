"""The token-mixer comparison (experiments/long_context/mixers.py): its generated recall rows checked
by brute force (every query's answer is the value paired with its key; the needle sits where its
distance says; weights on the answers and nowhere else), the variants' parameter counts, and the
command line end to end at --smoke sizes."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.long_context import mixers, recall
from tfm.models import DecoderLM


@pytest.mark.parametrize("pairs", [1, 4, 16, 64])
def test_mqar_queries_are_answered_by_their_paired_values(pairs):
    L = 256
    for i in range(20):
        row = recall.mqar(3, "test", i, L, pairs)
        t = row.tokens
        assert t.shape == (L + 1,) and t.dtype == np.int32 and row.weights.shape == (L,)
        paired = {}
        for p in range(0, 2 * pairs, 2):  # the pairs, read left to right
            assert t[p] in recall.KEYS and t[p + 1] in recall.VALUES and t[p] not in paired
            paired[int(t[p])] = int(t[p + 1])
        assert len(set(paired.values())) == pairs
        asked, answers = [], []
        for p in range(2 * pairs, 4 * pairs, 2):  # the queries: a key, then its value
            asked.append(int(t[p]))
            assert t[p + 1] == paired[int(t[p])]
            answers.append(p)  # target p (input p's next token) is an answer
        assert sorted(asked) == sorted(paired)  # every key asked once
        assert (t[4 * pairs:] == recall.PAD).all()
        expected = np.zeros(L, np.float32)
        expected[answers] = 1.0
        assert np.array_equal(row.weights, expected)
    b = recall.batch([recall.mqar(3, "test", i, L, pairs) for i in range(3)])
    assert np.array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert all(b["targets"][r, p] in recall.VALUES for r, p in zip(*np.nonzero(b["weights"])))


def test_rows_are_pure_and_their_streams_differ():
    a = recall.mqar(0, "train", 5, 64, 8).tokens
    assert np.array_equal(a, recall.mqar(0, "train", 5, 64, 8).tokens)
    for seed, split, index in ((0, "test", 5), (1, "train", 5), (0, "train", 6)):
        assert not np.array_equal(a, recall.mqar(seed, split, index, 64, 8).tokens)
    n = recall.needle(0, "train", 5, 64, range(1, 63)).tokens
    assert np.array_equal(n, recall.needle(0, "train", 5, 64, range(1, 63)).tokens)
    assert not np.array_equal(n, recall.needle(0, "test", 5, 64, range(1, 63)).tokens)
    with pytest.raises(ValueError, match=r"pairs=17 must be in 1 \.\. 64 with 4 \* pairs <= length \+ 1 = 65"):
        recall.mqar(0, "train", 0, 64, 17)
    with pytest.raises(ValueError, match=r"distances=range\(1, 64\) must be a non-empty range within 1 \.\. 62"):
        recall.needle(0, "train", 0, 64, range(1, 64))
    with pytest.raises(ValueError, match="split 'dev' unknown"):
        recall.mqar(0, "dev", 0, 64, 4)


def test_the_needle_sits_its_distance_before_the_question():
    L = 64
    seen = set()
    for i in range(300):
        row = recall.needle(2, "test", i, L, range(1, L - 1))
        t = row.tokens
        markers = np.nonzero(t == recall.MARKER)[0].tolist()  # brute force: find the markers
        assert len(markers) == 2 and markers[1] == L - 1  # the question is the last input
        value_at = markers[0] + 1
        distance = (L - 1) - value_at
        assert 1 <= distance <= L - 2
        seen.add(distance)
        assert t[value_at] in recall.VALUES and t[L] == t[value_at]  # the answer is the needle's value
        rest = np.delete(t, [markers[0], value_at, L - 1, L])
        assert rest.min() >= recall.FILLER.start and rest.max() < recall.FILLER.stop <= recall.VOCAB_SIZE
        assert row.weights[L - 1] == 1 and row.weights.sum() == 1
    assert len(seen) > 50 and min(seen) == 1 and max(seen) == L - 2
    near = [recall.needle(2, "test", i, L, range(5, 8)) for i in range(50)]
    assert {L - 2 - np.nonzero(r.tokens == recall.MARKER)[0][0] for r in near} == {5, 6, 7}


def test_distance_buckets_split_at_the_window_and_its_reach():
    assert recall.distance_buckets(256, 4, 32) == {"1-31": range(1, 32), "32-124": range(32, 125),
                                                   "125-254": range(125, 255)}
    assert recall.distance_buckets(32, 4, 32) == {"1-30": range(1, 31)}


def test_variants_are_their_mixers_at_about_the_same_size():
    counts, layers = {}, {}
    for name in mixers.VARIANTS:
        cfg = mixers.model_config(name, 64)
        params = nn.meta.unbox(jax.eval_shape(lambda: DecoderLM(cfg).init(jax.random.PRNGKey(0),
                                                                        jnp.zeros((1, 8), jnp.int32))["params"]))
        counts[name] = sum(x.size for x in jax.tree.leaves(params))
        layers[name] = [sorted(params["decoder"][f"layer_{i}"]) for i in range(cfg.num_layers)]
    assert all(abs(c / counts["full"] - 1) < 0.15 for c in counts.values()), counts
    attention, mixer = ["attn_norm", "ffn", "ffn_norm", "self_attn"], ["ffn", "ffn_norm", "mixer", "mixer_norm"]
    assert layers["full"] == layers["window"] == [attention] * 4
    assert layers["mamba2"] == layers["gated_deltanet"] == [mixer] * 4
    assert layers["hybrid"] == [mixer] * 3 + [attention]
    assert layers["kda"] == layers["lightning"] == layers["mlstm"] == [mixer] * 4 and layers["top_k"] == [attention] * 4
    assert mixers.model_config("top_k", 64).indexer.top_k == mixers.WINDOW
    assert mixers.model_config("window", 64).sliding_window == mixers.WINDOW
    assert mixers.model_config("full", 64).sliding_window is None
    with pytest.raises(ValueError, match="variant 'mamba' unknown"):
        mixers.model_config("mamba", 64)


def test_smoke_command_line(tmp_path, capsys):
    """Two variants (attention, with its chunked memory, and Mamba-2, without) through the whole
    command: training, held-out scores, memory, timing, the table, the JSON and the plot."""
    mixers.main(["--out", str(tmp_path), "--smoke", "--variants", "full,mamba2", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "== mamba2: 116,952 parameters" in out  # 2 layers at --smoke and "mqar step 3/3" in out and "needle held-out" in out
    table = (tmp_path / "mixers.md").read_text().splitlines()
    assert table[0].startswith("| variant | params | params / full | MQAR n=2 | MQAR n=4 | MQAR n=8 | needle d 1-30 |")
    assert [line.split(" | ")[0] for line in table[2:]] == ["| `full`", "| `mamba2`"]
    split = lambda line: line.strip("| ").split(" | ")
    cells = [dict(zip(split(table[0]), split(line))) for line in table[2:]]
    assert cells[1]["temp MiB L=32 chunked"] == "n/a" != cells[0]["temp MiB L=32 chunked"]  # mamba2 has no attention
    assert cells[0]["step time / full, mqar shape"] == cells[0]["step time / full, needle shape"] == "1.00"
    rows = json.loads((tmp_path / "mixers.json").read_text())["rows"]
    for r in rows.values():
        assert all(0 <= a <= 1 for a in [*r["mqar"].values(), *r["needle"].values()])
        assert r["memory"]["32"] > 0 and all(t > 0 for t in r["time_ratio"].values())
    assert rows["full"]["chunked"] > 0 and rows["mamba2"]["chunked"] is None
    assert (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--variants", "window,mamba2"], "--variants 'window,mamba2': choose from"),
    (["--variants", "full,mamba"], "'full' included"),
    (["--mqar-steps", "0"], "--steps / --mqar-steps = 0 must be >= 1")])
def test_command_line_errors_name_the_flag(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        mixers.main(["--out", str(tmp_path), *args])
    assert exit.value.code == 2 and message in capsys.readouterr().err
