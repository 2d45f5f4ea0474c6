"""Sharded training equals single-device training: BERT encoder and encoder-decoder (also with their
sequences split over `context`: ring attention, self- and cross-), MoE, latent attention, a Mamba-2 +
attention hybrid (its heads and recurrent state split over `tensor`)."""
import numpy as np
import pytest

from parallel_cases import losses

TOL = 1e-5  # fp32, absolute on the loss
CASES = [(f, m) for f in ("encoder", "encdec") for m in ("data2_tensor4", "fsdp4_tensor2")] + \
        [("moe", "expert4_data2"), ("moe", "fsdp4_expert2"), ("latent_attention", "fsdp4_tensor2"),
         ("hybrid", "fsdp4_tensor2"),
         ("encoder", "data2_context4"), ("encdec", "data2_context4")]


@pytest.mark.parametrize("family,mesh", CASES)
def test_sharded_losses_match_single_device(family, mesh):
    ref, got = np.array(losses(family, "single")), np.array(losses(family, mesh))
    assert ref[0] - ref[-1] > 0.05, f"the reference run should learn: {ref}"
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
