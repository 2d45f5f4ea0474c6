"""`python -m experiments.compare WORKDIR...`: two runs' config records diffed to the keys that differ
(the newest record of a resumed run), final and best metrics (lowest loss, highest accuracy) read from
metrics.jsonl as the train loop writes it, and their curves drawn."""
import json
import os

import pytest

from experiments import compare


def _run(workdir, config: dict, records: list, resumed: dict = None):
    os.makedirs(workdir)
    with open(workdir / "config.json", "w") as f:
        json.dump(config, f)
    if resumed:  # what a resumed run with a changed config writes beside config.json
        with open(workdir / "config.step20.json", "w") as f:
            json.dump(resumed, f)
    with open(workdir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(workdir)


def _records(losses, accuracies):
    """Train records every 10 steps and eval records every 20, as MetricLogger writes them."""
    out = []
    for i, (loss, acc) in enumerate(zip(losses, accuracies)):
        step = 10 * (i + 1)
        out.append({"step": step, "split": "train", "loss": loss + 0.1, "lr": 1e-3, "tokens_per_s": 5e3})
        if step % 20 == 0:
            out.append({"step": step, "split": "eval", "loss": loss, "accuracy": acc})
    return out


@pytest.fixture
def runs(tmp_path):
    base = {"seed": 0, "optimizer": {"learning_rate": 3e-3, "b2": 0.98}, "model": {"preset": "gpt2_small"},
            "model_config": {"position": "learned", "d_model": 32}}
    rope = json.loads(json.dumps(base))
    rope["model"]["overrides"] = {"position": "rope"}
    rope["model_config"]["position"] = "rope"
    later = json.loads(json.dumps(rope))
    later["optimizer"]["learning_rate"] = 1e-3  # changed on resume: the newest record counts
    return [_run(tmp_path / "lm_learned", base, _records([2.0, 1.6, 1.8, 1.7], [0.3, 0.4, 0.35, 0.38])),
            _run(tmp_path / "lm_rope", rope, _records([2.0, 1.7, 1.5, 1.45], [0.3, 0.4, 0.45, 0.46]), later)]


def test_the_report_names_the_differences_and_the_final_and_best_values(runs, tmp_path, capsys):
    compare.main([*runs, "--plot", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    diff = out.split("\n\n")[0].splitlines()
    assert diff == ["config keys that differ:", "| key | lm_learned | lm_rope |", "|---|---|---|",
                    "| model.overrides.position | (unset) | rope |", "| model_config.position | learned | rope |",
                    "| optimizer.learning_rate | 0.003 | 0.001 |"]
    rows = {tuple(line.split(" | ")[:2]): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["| eval", "loss"] == "| eval | loss | 1.7 (best 1.6 at step 20) | 1.45 (best 1.45 at step 40) |"
    assert rows["| eval", "accuracy"] == "| eval | accuracy | 0.38 (best 0.4 at step 20) | 0.46 (best 0.46 at step 40) |"
    assert rows["| train", "loss"] == "| train | loss | 1.8 (best 1.7 at step 20) | 1.55 (best 1.55 at step 40) |"
    assert ("| train", "lr") not in rows and ("| train", "tokens_per_s") not in rows  # not results
    assert os.path.getsize(tmp_path / "curves.png") > 10_000


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare.main([runs[0], str(tmp_path)])
    assert capsys.readouterr().err == f"error: {tmp_path} has no metrics.jsonl: give the --workdir of a run\n"
    with pytest.raises(SystemExit):
        compare.main([*runs, "--metric", "bleu", "--plot", str(tmp_path / "x.png")])
    assert capsys.readouterr().err.startswith("error: no run logged 'bleu'; metrics logged: ['accuracy', 'loss']")
