"""experiments/lm: the tiny config learns the generated corpus well below its unigram
entropy; sampling on the KV cache inside jit (the filters themselves: tests/test_decode.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common
from experiments.lm import train
from experiments.lm.configs import deepseek_v3, gpt2_small, kimi_k2, llama, llama2, tiny
from experiments.lm.settings import LMSettings
from tfm import decode
from tfm.train import LMTask


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    config = tiny.get_config()
    config.num_train_steps, config.eval_every, config.checkpoint_every = 150, 150, 0
    config.progress_bar, config.sample_tokens = False, 8
    return train.train_and_evaluate(config, str(tmp_path_factory.mktemp("lm")))


def test_tiny_lm_beats_unigram_entropy(result):
    loss = result.eval_history[-1]["loss"]
    print(f"unigram entropy {result.unigram_entropy:.3f}, eval loss {loss:.3f} nats/token")
    assert 3.5 < result.unigram_entropy < 5.5
    assert loss < 0.6 * result.unigram_entropy
    assert set(result.samples) == {"greedy", "top_k", "top_p"}


def test_top_k_one_equals_greedy(result):
    model, params = result.trainer.model, result.state.params
    prompt = jnp.asarray([[1, 5, 9], [1, 7, 3]], jnp.int32)
    sample = jax.jit(lambda p, key, **kw: decode.sample_lm(model, p, prompt, 6, key, **kw),
                     static_argnames=("greedy", "top_k", "temperature"))
    greedy = sample(params, jax.random.PRNGKey(0), greedy=True)
    for seed in range(3):
        top1 = sample(params, jax.random.PRNGKey(seed), top_k=1, temperature=0.7)
        np.testing.assert_array_equal(top1, greedy)


def test_every_config_loads():
    for module in (tiny, gpt2_small, llama, llama2, deepseek_v3, kimi_k2):
        for arg in ("", "runlocal"):
            c = module.get_config(arg)
            common.resolve(c, LMSettings, LMTask).model(c.vocab_size)
    for arg in ("long", "long,runlocal"):  # context parallelism: the sequence split over `context`
        c = llama2.get_config(arg)
        assert c.parallelism == "fsdp+context" and c.mesh.context == (1 if "runlocal" in arg else 4)
        assert common.resolve(c, LMSettings, LMTask).model(c.vocab_size).max_len >= c.seq_len
