"""benchmarks.step_profile's compile-only breakdown: the HLO parser on a hand-written module (every
number worked out by hand below), and the tiny GPT-2's step compiled for an H100, whose matmul,
logits and attention FLOPs match the model's closed form."""
import json

import pytest

from benchmarks import step_profile
from benchmarks.train_step import TINY
from tfm.preflight.targets import CHIPS, parse_target

# A cuBLAS gemm with its workspace, a weight converted by its own kernel and one inside the optimizer
# fusion, the logits' dot in a fusion, a reduction with its reducer, a transpose, a loop of 3 trips, a
# cuDNN attention call and a convolution.
HLO = """HloModule jit_train_step, is_scheduled=true

%convert_w (p.0: f32[64,32]) -> bf16[32,64] {
  %p.0 = f32[64,32]{1,0} parameter(0)
  %c.0 = bf16[64,32]{1,0} convert(%p.0), metadata={op_name="jit(train_step)/jvp(DecoderLM)/ffn/wi/convert_element_type"}
  ROOT %t.0 = bf16[32,64]{1,0} transpose(%c.0), dimensions={1,0}
}

%logits_dot (p.1: bf16[16,32], p.2: bf16[100,32]) -> f32[16,100] {
  %p.1 = bf16[16,32]{1,0} parameter(0)
  %p.2 = bf16[100,32]{1,0} parameter(1)
  %d.0 = bf16[16,100]{1,0} dot(%p.1, %p.2), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %c.1 = f32[16,100]{1,0} convert(%d.0)
}

%adam (p.3: f32[64,32], p.4: bf16[64,32]) -> f32[64,32] {
  %p.3 = f32[64,32]{1,0} parameter(0)
  %p.4 = bf16[64,32]{1,0} parameter(1)
  %c.2 = f32[64,32]{1,0} convert(%p.4)
  ROOT %a.0 = f32[64,32]{1,0} add(%p.3, %c.2), metadata={op_name="jit(train_step)/optimizer/add"}
}

%exp (p.6: bf16[16,32]) -> bf16[16,32] {
  %p.6 = bf16[16,32]{1,0} parameter(0)
  ROOT %x.0 = bf16[16,32]{1,0} exponential(%p.6)
}

%body (p.5: (s32[], bf16[16,32])) -> (s32[], bf16[16,32]) {
  %p.5 = (s32[], bf16[16,32]{1,0}) parameter(0)
  %i.0 = s32[] get-tuple-element(%p.5), index=0
  %g.0 = bf16[16,32]{1,0} get-tuple-element(%p.5), index=1
  %e.0 = bf16[16,32]{1,0} fusion(%g.0), kind=kLoop, calls=%exp, metadata={op_name="jit(train_step)/exp"}
  ROOT %tu.0 = (s32[], bf16[16,32]{1,0}) tuple(%i.0, %e.0)
}

%add (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %s.1 = f32[] add(%a.1, %b.1)
}

%row_sum (p.8: f32[16,100]) -> f32[16] {
  %p.8 = f32[16,100]{1,0} parameter(0)
  %z.0 = f32[] constant(0)
  ROOT %r.0 = f32[16]{0} reduce(%p.8, %z.0), dimensions={1}, to_apply=%add
}

%cond (p.7: (s32[], bf16[16,32])) -> pred[] {
  %p.7 = (s32[], bf16[16,32]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.7), index=0
  %n.0 = s32[] constant(3)
  ROOT %lt.0 = pred[] compare(%i.1, %n.0), direction=LT
}

ENTRY %main.9 (w: f32[64,32], x: bf16[16,64], emb: f32[100,32], g: bf16[64,32], q: bf16[2,16,4,8], k: bf16[2,16,4,8], v: bf16[2,16,4,8], img: f32[1,8,8,4], f: f32[3,3,4,16]) -> (f32[64,32], f32[16], bf16[32,16], (s32[], bf16[16,32]), (bf16[2,4,16,8], f32[2,4,16], u8[256]), f32[1,8,8,16]) {
  %w = f32[64,32]{1,0} parameter(0), metadata={op_name="state.params['wi']"}
  %x = bf16[16,64]{1,0} parameter(1), metadata={op_name="batch['inputs']"}
  %emb = f32[100,32]{1,0} parameter(2), metadata={op_name="state.params['embed']"}
  %g = bf16[64,32]{1,0} parameter(3)
  %q = bf16[2,16,4,8]{3,2,1,0} parameter(4)
  %k = bf16[2,16,4,8]{3,2,1,0} parameter(5)
  %v = bf16[2,16,4,8]{3,2,1,0} parameter(6)
  %img = f32[1,8,8,4]{3,2,1,0} parameter(7)
  %f = f32[3,3,4,16]{3,2,1,0} parameter(8)
  %wc = bf16[32,64]{1,0} fusion(%w), kind=kLoop, calls=%convert_w, metadata={op_name="jit(train_step)/jvp(DecoderLM)/ffn/wi/convert_element_type"}
  %gemm = (bf16[16,32]{1,0}, s8[4096]{0}) custom-call(%x, %wc), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(DecoderLM)/ffn/wi/BTD,DF->BTF/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %h = bf16[16,32]{1,0} get-tuple-element(%gemm), index=0
  %embc = bf16[100,32]{1,0} convert(%emb), metadata={op_name="jit(train_step)/jvp(DecoderLM)/output/convert_element_type"}
  %logits = f32[16,100]{1,0} fusion(%h, %embc), kind=kCustom, calls=%logits_dot, metadata={op_name="jit(train_step)/jvp(DecoderLM)/output/BTD,VD->BTV/dot_general"}
  %sums = f32[16]{0} fusion(%logits), kind=kInput, calls=%row_sum, metadata={op_name="jit(train_step)/reduce_sum"}
  %upd = f32[64,32]{1,0} fusion(%w, %g), kind=kLoop, calls=%adam, metadata={op_name="jit(train_step)/optimizer/add"}
  %tr = bf16[32,16]{1,0} transpose(%h), dimensions={1,0}, metadata={op_name="jit(train_step)/jvp(DecoderLM)/layer_0/self_attn/attention/transpose"}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,32]{1,0}) tuple(%zero, %h)
  %loop = (s32[], bf16[16,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %attn = (bf16[2,4,16,8]{3,2,1,0}, f32[2,4,16]{2,1,0}, u8[256]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/jvp(DecoderLM)/layer_0/self_attn/attention/dot_product_attention_fwd"}, backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","4","16","16"]}}}
  %conv = f32[1,8,8,16]{3,2,1,0} convolution(%img, %f), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  ROOT %out = (f32[64,32]{1,0}, f32[16]{0}, bf16[32,16]{1,0}, (s32[], bf16[16,32]{1,0}), (bf16[2,4,16,8]{3,2,1,0}, f32[2,4,16]{2,1,0}, u8[256]{0}), f32[1,8,8,16]{3,2,1,0}) tuple(%upd, %sums, %tr, %loop, %attn, %conv)
}
"""

# (name, category, bytes = results + operands, FLOPs, runs per step)
EXPECTED = [
    ("wc", "weight convert", 32 * 64 * 2 + 64 * 32 * 4, 0, 1),
    ("gemm", "matmul", 16 * 32 * 2 + 16 * 64 * 2 + 32 * 64 * 2, 2 * 16 * 32 * 64, 1),  # workspace left out
    ("embc", "weight convert", 100 * 32 * 2 + 100 * 32 * 4, 0, 1),
    ("logits", "logits/cross-entropy", 16 * 100 * 4 + 16 * 32 * 2 + 100 * 32 * 2, 2 * 16 * 100 * 32, 1),
    ("sums", "reduction", 16 * 4 + 16 * 100 * 4, 0, 1),
    ("upd", "optimizer", 64 * 32 * 4 * 2 + 64 * 32 * 2, 0, 1),
    ("tr", "copy/transpose", 2 * 16 * 32 * 2, 0, 1),  # a move, whatever its scope
    ("e.0", "elementwise", 2 * 16 * 32 * 2, 0, 3),  # the loop body's kernel, 3 trips
    # cuDNN forward: O + softmax stats (its u8 scratch left out), Q, K, V; 2 products of B N T S x H
    ("attn", "attention", 2 * 4 * 16 * 8 * 2 + 2 * 4 * 16 * 4 + 3 * 2 * 16 * 4 * 8 * 2, 2 * (2 * 4 * 16 * 16) * (8 + 8), 1),
    # 3 x 3 over 4 input features for each of 8 x 8 x 16 outputs
    ("conv", "matmul", (8 * 8 * 16 + 8 * 8 * 4 + 3 * 3 * 4 * 16) * 4, 2 * 8 * 8 * 16 * 3 * 3 * 4, 1),
]


def test_breakdown_of_a_hand_written_module():
    kernels, converts = step_profile.breakdown(HLO)
    got = [(k.name, k.category, k.bytes, k.flops, k.count) for k in kernels]
    assert got == EXPECTED
    assert converts == [("wc", "weight convert", "f32[64,32] -> bf16"), ("embc", "weight convert", "f32[100,32] -> bf16"),
                        ("upd", "optimizer", "bf16[64,32] -> f32")]
    assert kernels[3].op_name == "jvp(DecoderLM)/output/BTD,VD->BTV/dot_general"
    totals = step_profile.category_totals(kernels, CHIPS["h100"])
    assert totals["elementwise"]["kernels"] == 3 and totals["elementwise"]["bytes"] == 3 * 2048
    assert totals["matmul"]["flops"] == 2 * 16 * 32 * 64 + 2 * 8 * 8 * 16 * 3 * 3 * 4
    lines = step_profile.breakdown_lines(kernels, converts, CHIPS["h100"])
    assert "| f32[64,32] -> bf16 | its own kernel | 1 |" in lines and "| bf16[64,32] -> f32 | fused in optimizer | 1 |" in lines


def test_compile_only_tiny_gpt2_counts_the_closed_form_flops(tmp_path):
    """TINY GPT-2 (L 2, D 64, F 128, V 50,257), bf16, B 2 x T 128, xla attention, compiled for an
    H100. Forward matmul FLOPs per token: 2 L (4 D² + 2 D F) in the layers, 2 D V' in the logits (V'
    = 50,304: logits_block_size's 128 on a GPU), 4 L T D in attention (full T x S scores); a training
    step is 3 times the forward. Layers and attention exactly; the logits within 1% (XLA splits the
    hidden states' gradient over the vocabulary, padding it to 64 splits of 792: +0.25%)."""
    try:
        parse_target("h100-1").devices()
    except ValueError as error:  # the CUDA compile-only plugin is missing (make compile-plugins)
        pytest.skip(str(error))
    B, T, L, D, F = 2, 128, TINY["num_layers"], TINY["d_model"], TINY["d_ff"]
    step_profile.main(["--compile-only", "--tiny", "--model", "gpt2", "--batches", str(B), "--seq", str(T),
                       "--impl", "xla", "--out", str(tmp_path)])
    record, = json.loads((tmp_path / "breakdown.json").read_text())
    flops = {name: totals["flops"] for name, totals in record["categories"].items()}
    tokens = B * T
    assert flops["matmul"] == 3 * tokens * 2 * L * (4 * D * D + 2 * D * F)
    assert flops["attention"] == 3 * tokens * 4 * L * T * D
    assert flops["logits/cross-entropy"] == pytest.approx(3 * tokens * 2 * D * 50_304, rel=0.01)
    assert "### tiny gpt2 2×128, attention xla" in (tmp_path / "breakdown.md").read_text()
