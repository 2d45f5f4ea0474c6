"""The translation experiment end to end at toy scale: generated corpus -> SentencePiece ->
packed Grain batches -> Trainer -> greedy decoding -> BLEU."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common
from experiments.translation import evaluate, train
from experiments.translation.configs import base, big
from experiments.translation.settings import TranslationSettings
from tfm.data import pipeline
from tfm.models import EncoderDecoder
from tfm.train import Seq2SeqTask


def test_runlocal_config_trains_and_reports_bleu(tmp_path):
    config = base.get_config("runlocal")
    config.num_train_steps = 60
    config.synthetic_pairs = 600
    config.eval_examples = 16
    config.log_every = 20
    config.optimizer.warmup_steps = 10
    config.checkpoint_every, config.keep_checkpoints, config.average_last = 30, 2, 2
    config.eval_every, config.eval_bleu_examples, config.keep_best = 30, 8, "bleu_moses_compound_split"
    scores = train.train_and_evaluate(config, str(tmp_path))
    evals = scores["eval_history"]
    assert [e["step"] for e in evals] == [30, 60]
    assert all({"loss", "accuracy", "sacrebleu", "bleu_moses_compound_split"} <= set(e) for e in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]  # validation loss falls
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["metric"] == "bleu_moses_compound_split"
    assert best["value"] == max(e["bleu_moses_compound_split"] for e in evals)
    assert 0.0 <= scores["sacrebleu"] <= 100.0 and 0.0 <= scores["bleu_moses_compound_split"] <= 100.0
    assert scores["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert scores["test_set"] == "TFDS tfm_synthetic_translate test, 16 lines"
    assert len(scores["samples"]) == 16
    assert scores["averaged_checkpoints"] == 2  # steps 30 and 60
    assert scores["final_loss"] < 4.8  # ln(256) = 5.55 at initialisation
    assert (tmp_path / "spm_256.model").exists()
    again = evaluate.evaluate(str(tmp_path), average_last=2)  # without training: the same scores
    assert {k: again[k] for k in ("sacrebleu", "bleu_moses_compound_split", "test_set", "averaged_checkpoints")} == \
        {k: scores[k] for k in ("sacrebleu", "bleu_moses_compound_split", "test_set", "averaged_checkpoints")}
    assert open(again["translations"]).read().splitlines() == [hyp for _, hyp, _ in scores["samples"]]


PAPER = {  # Vaswani et al. 2017, section 5 and Table 3
    "base": dict(preset="transformer_base", d_model=512, d_ff=2048, num_heads=8, dropout_rate=0.1,
                 num_train_steps=100_000, noam_d_model=512, average_last=5),
    "big": dict(preset="transformer_big", d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3,
                num_train_steps=300_000, noam_d_model=1024, average_last=20),
}


@pytest.mark.parametrize("name,module", [("base", base), ("big", big)])
def test_configs_hold_the_paper_values(name, module):
    paper = PAPER[name]
    exp = common.resolve(module.get_config(), TranslationSettings, Seq2SeqTask, batch_size=112)
    model = exp.model(exp.settings.vocab_size)
    assert exp.preset == paper["preset"] and exp.overrides == {"execution": {"dtype": "bfloat16", "attention_impl": "auto"}}  # how, not what
    assert (model.d_model, model.d_ff, model.num_heads, model.num_layers, model.dropout_rate) == (
        paper["d_model"], paper["d_ff"], paper["num_heads"], 6, paper["dropout_rate"])
    assert (model.norm_position, model.share_source_target_embeddings, model.tie_embeddings) == ("post", True, True)
    opt = exp.train.optimizer
    assert (opt.name, opt.b1, opt.b2, opt.eps, opt.clip_grad_norm) == ("adam", 0.9, 0.98, 1e-9, None)
    assert (opt.schedule, opt.warmup_steps, opt.learning_rate, opt.noam_d_model) == ("noam", 4000, 1.0, paper["noam_d_model"])
    assert exp.train.num_train_steps == paper["num_train_steps"]
    assert exp.task.label_smoothing == 0.1
    s = exp.settings
    assert (s.dataset, s.vocab_size, s.beam_size, s.alpha) == ("wmt14", 37_000, 4, 0.6)
    assert (s.tokens_per_batch, s.max_length) == (25_000, 256)
    assert s.average_last == paper["average_last"] <= exp.train.keep_checkpoints
    params = jax.eval_shape(lambda: EncoderDecoder(model).init(
        jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)))["params"]
    count = sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params)))
    assert count == {"base": 63_082_496, "big": 214_245_376}[name]  # tests/test_config.py's formulas


def test_token_budget_gives_that_many_tokens_per_step_on_each_side():
    """Lognormal lengths (mean ~32 tokens, max 250) on both sides; a 12k-token budget per side:
    the measured mean over 12 steps is within 10% of it on each side."""
    class Words:  # one token per word
        bos_id, eos_id = 1, 2

        def encode(self, text):
            return [7] * len(text.split())

    rng = np.random.default_rng(0)
    lengths = lambda n: np.clip(np.round(np.exp(rng.normal(np.log(27), 0.6, n))), 1, 250).astype(int)
    pairs = [{"en": "w " * a, "de": "w " * b} for a, b in zip(lengths(8000), lengths(8000))]
    rows = pipeline.rows_for_token_budget(pairs, Words(), tokens_per_batch=12_000, max_length=256, multiple=4)
    assert rows % 4 == 0
    batches = [b for b, _ in zip(pipeline.seq2seq_dataset(pairs, Words(), batch_size=rows, max_length=256, seed=3),
                                 range(12))]
    source = np.mean([(b["inputs_segment_ids"] > 0).sum() for b in batches])
    target = np.mean([b["weights"].sum() for b in batches])
    assert abs(source / 12_000 - 1) < 0.1 and abs(target / 12_000 - 1) < 0.1, (rows, source, target)
