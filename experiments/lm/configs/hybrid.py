"""Hybrid linear-time + attention decoders at their published shapes, trained on lm1b as a stand-in corpus:
for running tfm's token mixers at scale (sharding, memory, the chunked scans in a real step), not for
reproducing the models' quality.

Model: `qwen3_next_80b_a3b` (position='rope', num_layers=48, d_model=2048, num_experts=512), mixer_pattern 3
  gated_deltanet to 1 attention; `:nemotron_h` builds `nemotron_h_8b` (no positions; Mamba-2, attention and
  feed-forward layers by its pattern)

`:qwen3_next` (default): Qwen3-Next-80B-A3B (`tfm.models.presets.qwen3_next_80b_a3b`: 48 layers, three
           gated DeltaNet layers to one gated attention layer, 512 experts top-10 + a shared expert on
           every layer), 4096 tokens, 1024 sequences (4M tokens) a step in passes of one sequence per chip;
           FSDP over every chip with expert parallelism over `expert` = 8, the layers scanned in groups of
           4 and rematerialised, each chip's MoE tokens in 8 chunks, the loss in vocabulary chunks.
`:kimi_linear`: Kimi Linear 48B-A3B (`presets.kimi_linear_48b_a3b`: 27 layers, KDA with MLA at every fourth
           from the fifth, 256 experts top-8 after a dense first layer), 4096 tokens, as `:qwen3_next` (the
           layers looped: the published pattern does not repeat).
`:nemotron_h`: Nemotron-H-8B (`presets.nemotron_h_8b`: 52 one-sublayer layers, 24 Mamba-2, 4 attention,
           24 squared-ReLU feed-forwards), 8192 tokens, 256 sequences (2M tokens) a step, FSDP, each layer
           rematerialised (the published pattern does not repeat, so the layers are looped, not scanned).
Both:      bf16 compute, fp32 parameters and AdamW (lr 3e-4, b2 0.95, weight decay 0.1, clip 1.0); the
           mixers run their chunked forms (execution.mixer_impl auto, chunks of 64 tokens).
Command:   python -m experiments.lm.train --config=experiments/lm/configs/hybrid.py:qwen3_next --workdir=DIR
Preflight: python -m experiments.preflight --config=experiments/lm/configs/hybrid.py:qwen3_next --target=v5p-128 --noeval
           python -m experiments.preflight --config=experiments/lm/configs/hybrid.py:nemotron_h --target=h100-8 --noeval
Hardware:  qwen3_next: v5p-128 (64 chips; fp32 parameters and AdamW alone are 0.96 TB, more than one
           8-GPU node holds): the preflight (2026-11-28) fits at 52.18 GiB of 95 GiB per chip; nemotron_h: one node of 8 H100s: the preflight
           (2026-11-28) fits at 47.94 GiB of 79.14 GiB per GPU (11.33 GiB parameters + AdamW, 36.61 GiB
           temporaries). benchmarks/RESULTS.md ("Linear-time mixers").
Runtime:   not run on hardware.
Expected:  no published lm1b figure at this scale.
`,runlocal` shrinks either to a CPU smoke run (a tiny hybrid of the same mixers).
"""
from experiments.lm.configs import gpt2_small

VARIANTS = {
    "qwen3_next": dict(preset="qwen3_next_80b_a3b", vocab_size=151_936, seq_len=4096, batch=1024, chips=64,
                       expert=8, scan_layers=True),
    "nemotron_h": dict(preset="nemotron_h_8b", vocab_size=131_072, seq_len=8192, batch=256, chips=8, expert=1,
                       scan_layers=False),
    "kimi_linear": dict(preset="kimi_linear_48b_a3b", vocab_size=163_840, seq_len=4096, batch=1024, chips=64,
                        expert=8, scan_layers=False),
}
TINY = {  # runlocal: the same mixers at CPU size
    "qwen3_next": dict(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=4, d_ff=16, max_len=64,
                       num_experts=4, experts_per_token=2, shared_expert_d_ff=16, rope=dict(dim=4),
                       deltanet=dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8)),
    "nemotron_h": dict(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=4, d_ff=64, max_len=64,
                       mixer_pattern=("mamba2", "attention", "none", "mamba2"),
                       ffn_pattern=("none", "none", "dense", "none"),
                       mamba2=dict(state_size=8, head_dim=8, groups=2)),
    "kimi_linear": dict(d_model=32, num_heads=2, num_kv_heads=2, head_dim=12, num_layers=4, d_ff=16, max_len=64,
                        mixer_pattern=("kda", "kda", "kda", "attention"), kda=dict(heads=2, head_dim=8),
                        mla=dict(kv_rank=8, rope_dim=4, q_rank=None, value_dim=8), num_experts=4,
                        experts_per_token=2, dense_layers=1, dense_d_ff=32),
}
VOCAB_CHUNK = 16_384


def get_config(arg: str = "qwen3_next"):
    variant, _, local = (arg or "qwen3_next").partition(",")
    if variant == "runlocal":
        variant, local = "qwen3_next", "runlocal"
    if variant not in VARIANTS or local not in ("", "runlocal"):
        raise ValueError(f"hybrid.py:{arg}: choose {' or '.join(VARIANTS)} (optionally ,runlocal)")
    v = VARIANTS[variant]
    c = gpt2_small.get_config()
    c.model.preset = v["preset"]
    c.model.overrides = dict(execution=dict(dtype="bfloat16", attention_impl="auto", scan_layers=v["scan_layers"],
                                            remat_policy="full", moe_chunks=8 if v["expert"] > 1 else 1))
    c.vocab_size, c.seq_len = v["vocab_size"], v["seq_len"]
    c.task.vocab_chunk = VOCAB_CHUNK
    c.batch_size = v["batch"]
    c.microbatches = v["batch"] // v["chips"]
    c.optimizer.update(name="adamw", learning_rate=3e-4, warmup_steps=2000, schedule="cosine", weight_decay=0.1,
                       b2=0.95, clip_grad_norm=1.0)
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, -1, v["expert"]
    c.parallelism = "fsdp+expert" if v["expert"] > 1 else "fsdp"
    if local:
        gpt2_small.shrink(c)
        # fp32: XLA:CPU has no bf16 matmul with an fp32 result, which the vocabulary-chunked loss's backward uses
        c.model.overrides.update(TINY[variant], execution=dict(dtype="float32", attention_impl="xla",
                                                               remat_policy="none", scan_layers=False, moe_chunks=1))
        c.microbatches, c.mesh.expert, c.parallelism = 1, 1, "fsdp"
    return c
