"""The translation experiment end to end at toy scale: generated corpus -> SentencePiece ->
packed Grain batches -> Trainer -> greedy decoding -> BLEU."""
import json

from experiments.translation import train
from experiments.translation.configs import base


def test_runlocal_config_trains_and_reports_bleu(tmp_path):
    config = base.get_config("runlocal")
    config.num_train_steps = 60
    config.synthetic_pairs = 600
    config.eval_examples = 16
    config.log_every = 20
    config.optimizer.warmup_steps = 10
    config.checkpoint_every, config.keep_checkpoints, config.average_last = 30, 2, 2
    config.eval_every, config.eval_bleu_examples, config.keep_best = 30, 8, "sacrebleu"
    scores = train.train_and_evaluate(config, str(tmp_path))
    evals = scores["eval_history"]
    assert [e["step"] for e in evals] == [30, 60]
    assert all({"loss", "accuracy", "sacrebleu", "tokenized_bleu"} <= set(e) for e in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]  # validation loss falls
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["metric"] == "sacrebleu" and best["value"] == max(e["sacrebleu"] for e in evals)
    assert 0.0 <= scores["sacrebleu"] <= 100.0 and 0.0 <= scores["tokenized_bleu"] <= 100.0
    assert len(scores["samples"]) == 16
    assert scores["averaged_checkpoints"] == 2  # steps 30 and 60
    assert scores["final_loss"] < 4.8  # ln(256) = 5.55 at initialisation
    assert (tmp_path / "spm_256.model").exists()


def test_base_config_is_the_paper_setting():
    c = base.get_config()
    assert (c.model.preset, c.vocab_size, c.task.label_smoothing) == ("transformer_base", 37_000, 0.1)
    assert (c.optimizer.b1, c.optimizer.b2, c.optimizer.eps) == (0.9, 0.98, 1e-9)
    assert (c.optimizer.schedule, c.optimizer.warmup_steps, c.num_train_steps) == ("noam", 4000, 100_000)
