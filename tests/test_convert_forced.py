"""Forcing a converter onto another family's checkpoint (`from_hf(model, architecture=...)`) gives either a
one-line refusal or that family's logits, never a silent difference.

Every decoder-only converter is forced onto every tiny model of the 2025-26 zoo (tests/test_zoo_recent.py) and
of the Llama, Mistral and Qwen2 cases of tests/test_zoo_decoders.py: a conversion that succeeds must match the
model's own transformers logits (1e-4); the rest raise ConversionError in one line. The two silent failures
seen before converters refused unread fields (SmolLM3 and Granite forced as Llama: max |logit diff| 8.3e-2 and
1.7) are refused by the field that changes them.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from test_zoo_decoders import FAMILIES as OLDER  # noqa: E402
from test_zoo_recent import FAMILIES as RECENT, MASK, T, max_abs, randomize, tokens  # noqa: E402
from tfm.convert import CONVERTERS, ConversionError, from_hf  # noqa: E402
from tfm.models import DecoderLM  # noqa: E402

MODELS = {**RECENT, **{name: OLDER[name] for name in ("llama3", "mistral", "qwen2")}}
DECODERS = sorted(a for a, c in CONVERTERS.items() if c.model_class is DecoderLM)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {name: randomize(make()) for name, make in MODELS.items()}


def test_every_forced_conversion_is_parity_or_a_one_line_refusal(models):
    ids = tokens(1)
    outcomes = {}
    for name, hf in models.items():
        with torch.no_grad():
            ref = hf(torch.tensor(ids), attention_mask=torch.tensor(MASK)).logits.numpy()
        for arch in DECODERS:
            try:
                _, params, model = from_hf(hf, architecture=arch)
            except ConversionError as e:
                assert "\n" not in str(e), (name, arch, str(e))
                outcomes[name, arch] = "refused"
                continue
            pos = jnp.broadcast_to(jnp.arange(T), ids.shape)
            logits = jax.jit(model.apply)({"params": params}, jnp.asarray(ids), segment_ids=jnp.asarray(MASK),
                                          positions=pos).logits
            diff = max_abs(logits, ref, MASK)
            assert diff < 1e-4, f"{arch} imports {name} ({type(hf).__name__}) silently wrong: max-abs {diff:.2e}"
            outcomes[name, arch] = "parity"
    own = {(n, type(m).__name__) for n, m in models.items()}
    assert all(outcomes[key] == "parity" for key in own)
    parity = sorted(k for k, v in outcomes.items() if v == "parity" and k not in own)
    print(f"{len(outcomes)} forced conversions: {len(own)} own, parity beyond them {parity}")


@pytest.mark.parametrize("name,field", [("smollm3", "no_rope_layers"), ("granite", "attention_multiplier"),
                                        ("olmo3", "rope_parameters"), ("cohere2", "layer_norm_eps")])
def test_a_forced_llama_converter_names_the_field_it_does_not_read(models, name, field):
    with pytest.raises(ConversionError, match=field):
        from_hf(models[name], architecture="LlamaForCausalLM")


@pytest.mark.parametrize("arch", sorted(CONVERTERS))
def test_every_field_of_the_architectures_config_class_is_read_or_declared_inert(arch):
    """Every registered converter reads each field its transformers config class has (at its defaults) or declares
    it inert: a field added to the class, or a family registered without reading one, fails here by name. (A
    refusal of a default value, such as GLM-4.5's odd rotary width at its defaults, is not a failure.)"""
    fields = getattr(tr, arch).config_class().to_dict()
    try:
        CONVERTERS[arch].read_config(fields, arch)
    except ConversionError as e:
        assert "is not read by" not in str(e), str(e)
