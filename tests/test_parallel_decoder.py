"""Sharded training equals single-device training: GPT-2-style decoder, seven meshes (the last three
split the sequence over `context`: ring attention, tfm.ops.context)."""
import numpy as np
import pytest

from parallel_cases import losses

TOL = 1e-5  # fp32, absolute on the loss


@pytest.mark.parametrize("mesh", ["data8", "fsdp8", "data2_tensor4", "fsdp4_tensor2", "data2_context4",
                                  "context4", "context2_tensor2"])
def test_decoder_sharded_losses_match_single_device(mesh):
    ref, got = np.array(losses("decoder", "single")), np.array(losses("decoder", mesh))
    assert ref[0] - ref[-1] > 0.05, f"the reference run should learn: {ref}"
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
