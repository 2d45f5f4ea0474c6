"""Every experiment's real-dataset path on tfds.testing.mock_data, with the real builders'
split names and features: a split the real dataset lacks, or a feature the code reads that
it does not have, fails here (the generated corpora cannot show that)."""
import dataclasses

import pytest

import tfds_mock
from experiments import common
from experiments.lm import train as lm_train
from experiments.lm.configs import gpt2_small, llama
from experiments.lm.settings import LMSettings
from experiments.translation import train as translation_train
from experiments.translation.configs import base
from experiments.translation.settings import TranslationSettings
from tfm.data import pipeline, sources, synthetic, tokenizers
from tfm.train import LMTask, Seq2SeqTask


@pytest.fixture(scope="module")
def tok():
    return tokenizers.train_sentencepiece((t for pair in synthetic.translation_pairs(300, 0) for t in pair), 200)


@pytest.mark.parametrize("recipe", [gpt2_small, llama], ids=["gpt2_small", "llama"])
def test_lm_configs_read_lm1b_splits_that_exist(recipe, tok, tmp_path):
    settings = common.resolve(recipe.get_config(), LMSettings, LMTask).settings
    assert settings.dataset == "lm1b"
    with tfds_mock.mock_data(num_examples=10):
        train, held_out = lm_train.load_splits(settings, str(tmp_path))
        for split in (train, held_out):
            batch = next(iter(pipeline.lm_dataset(split, tok, batch_size=2, seq_len=16)))
            assert batch["weights"].sum() > 0
    bad = dataclasses.replace(settings, eval_split="validation")
    with tfds_mock.mock_data(num_examples=10), pytest.raises(ValueError, match="lm1b has no split 'validation'"):
        lm_train.load_splits(bad, str(tmp_path))


def test_translation_config_reads_wmt14_train_newstest2013_and_2014(tok, tmp_path):
    settings = common.settings_of(base.get_config(), TranslationSettings)
    assert sources.resolve(settings.dataset) == "wmt14_translate/de-en"
    with tfds_mock.mock_data(num_examples=10):
        for split in translation_train.load_sources(settings, str(tmp_path)):
            assert {"en", "de"} <= set(split[0])
            batch = next(iter(pipeline.seq2seq_dataset(split, tok, batch_size=2, max_length=32)))
            assert batch["weights"].sum() > 0
