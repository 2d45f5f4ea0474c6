"""Edges of the public API and the command line: lazy `import tfm`, the local corpus generator's
messages, progress lines in logs and size-less terminals, `sample_lm` arguments, `from_hf` on
non-finite tensors."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, cwd=ROOT) -> str:
    """Runs `code` in a fresh interpreter with stdout and stderr redirected to one pipe; the
    output as bytes decoded, carriage returns kept."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    out = done.stdout.decode()
    assert done.returncode == 0, out
    return out


def test_import_tfm_reaches_every_subpackage_lazily():
    out = run_python("""
        import sys, tfm
        print("jax loaded by import tfm:", "jax" in sys.modules)
        print(tfm.convert.from_hf.__name__, tfm.decode.sample_lm.__name__, tfm.train.Trainer.__name__,
              tfm.models.DecoderLM.__name__, tfm.config.ModelConfig.__name__, tfm.parallel.make_mesh.__name__)
        print(all(hasattr(tfm, name) for name in tfm.SUBMODULES))
    """)
    assert "jax loaded by import tfm: False" in out
    assert "from_hf sample_lm Trainer DecoderLM ModelConfig make_mesh\nTrue" in out


def test_unknown_tfm_attribute_lists_the_subpackages():
    import tfm
    with pytest.raises(AttributeError, match="no attribute 'covnert'.*'convert'"):
        tfm.covnert


def test_generating_the_local_corpus_does_not_claim_a_download(tmp_path):
    out = run_python(f"""
        from tfm.data import synthetic
        synthetic.prepare_translation({str(tmp_path)!r}, train=4, validation=1, test=1)
        synthetic.prepare_documents({str(tmp_path)!r}, train=2, validation=1, test=1)
    """, cwd=tmp_path)
    assert "Download" not in out and "download" not in out.replace("nothing is downloaded", "")
    assert out.count("nothing is downloaded") == 2
    assert "Generated tfm_synthetic_translate" in out and "Generated tfm_synthetic_docs" in out


def test_progress_in_a_redirected_log_is_plain_lines(tmp_path):
    out = run_python(f"""
        from tfm.train.metrics import MetricLogger
        logger = MetricLogger({str(tmp_path)!r}, total_steps=5)
        for step in range(1, 6):
            logger.advance()
            logger.write(step, {{"loss": 1.0 / step, "accuracy": 0.5}})
        logger.close()
    """)
    assert "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert lines == [f"step {i} train: loss={1.0 / i:.4g} accuracy=0.5" for i in range(1, 6)]


def test_progress_in_a_terminal_that_reports_no_size_is_plain_lines(tmp_path):
    """A pseudo-terminal starts with size 0 x 0 (as some CI and container consoles report): tqdm
    would draw a bar of width 0, i.e. nothing, so the logger prints plain step lines instead."""
    import pty
    code = f"""
        from tfm.train.metrics import MetricLogger
        logger = MetricLogger({str(tmp_path)!r}, total_steps=3)
        for step in range(1, 4):
            logger.advance()
            logger.write(step, {{"loss": 1.0 / step}})
        logger.close()
    """
    parent, child = pty.openpty()
    assert os.get_terminal_size(child).columns == 0
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdin=child, stdout=child,
                            stderr=child, env={**os.environ, "PYTHONPATH": ROOT})
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(parent, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(parent)
    assert proc.wait(timeout=300) == 0, out.decode()
    lines = [line for line in out.decode().replace("\r\n", "\n").splitlines() if line.startswith("step ")]
    assert lines == [f"step {i} train: loss={1.0 / i:.4g}" for i in range(1, 4)], out.decode()


@pytest.fixture(scope="module")
def lm():
    from tfm.models import DecoderLM
    from tfm.models.presets import tiny
    model = DecoderLM(tiny("decoder"))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return model, params


def test_sample_lm_zero_new_tokens_is_the_empty_continuation(lm):
    from tfm.decode import sample_lm
    out = sample_lm(*lm, jnp.ones((2, 3), jnp.int32), 0, jax.random.PRNGKey(0))
    assert out.shape == (2, 0) and out.dtype == jnp.int32


@pytest.mark.parametrize("n", [-1, 2.5, None])
def test_sample_lm_bad_token_count_is_a_clear_error(lm, n):
    from tfm.decode import sample_lm
    with pytest.raises(ValueError, match=rf"max_new_tokens must be an int >= 0, got {n}"):
        sample_lm(*lm, jnp.ones((2, 3), jnp.int32), n, jax.random.PRNGKey(0))


def test_sample_lm_empty_prompt_is_a_clear_error(lm):
    from tfm.decode import sample_lm
    with pytest.raises(ValueError, match=r"prompt must be token ids \[batch, length >= 1\], got shape \(2, 0\)"):
        sample_lm(*lm, jnp.ones((2, 0), jnp.int32), 3, jax.random.PRNGKey(0))


def tiny_gpt2():
    tr = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                            attn_implementation="eager"))


def test_from_hf_names_a_non_finite_tensor_of_a_live_model():
    import torch
    from tfm.convert import ConversionError, from_hf
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[2, 5] = float("nan")
    with pytest.raises(ConversionError, match=r"tensor 'transformer\.h\.0\.mlp\.c_fc\.weight' holds 1 non-finite value\(s\), "
                                              r"the first nan at index \(2, 5\)"):
        from_hf(model)


def test_from_hf_names_a_non_finite_tensor_in_a_checkpoint_directory(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    from tfm.convert import ConversionError, from_hf
    tiny_gpt2().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = next(k for k in tensors if k.endswith("ln_f.weight"))
    tensors[key] = torch.full_like(tensors[key], float("inf"))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=rf"tensor '{key}' holds 16 non-finite value\(s\), the first inf"):
        from_hf(tmp_path)
