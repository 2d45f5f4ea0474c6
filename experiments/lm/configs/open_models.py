"""Open models of 2025 at their published shapes, trained on lm1b as a stand-in corpus: for sizing and running
their architectures at scale (sharding, memory, attention sinks, sandwich norms, per-layer RoPE), not for
reproducing their quality. `tfm.convert.from_hf` imports their checkpoints into the same configs.

Model: `gpt_oss_120b` (position='rope', num_layers=36, d_model=2880, num_experts=128, attention_sinks=True);
  `:gemma3_27b` builds `gemma3_27b` (num_layers=62, d_model=5376, norm_position='sandwich', local_rope)

`:gpt_oss_120b` (default): gpt-oss-120b (`tfm.models.presets.gpt_oss_120b`: 36 layers alternating a 128-token
           window and full attention with sinks, 128 biased experts top-4 with clamped SwiGLU on every layer),
           4096 tokens, 512 sequences (2M tokens) a step in passes of one sequence per chip; FSDP over every chip
           with expert parallelism over `expert` = 8, the layers scanned in (local, global) pairs and
           rematerialised, each chip's MoE tokens in 4 chunks. Attention "auto": the sinks run on the backends
           declaring them (xla), not the flash kernels.
`:gemma3_27b`: Gemma 3 27B's text model (`presets.gemma3_27b`: 62 layers, five 1024-window layers to one global,
           sandwich norms, q/k norms, local RoPE base 10k beside the global 1M x8), 4096 tokens, 512 sequences
           (2M tokens) a step, FSDP over one node's 8 GPUs (a whole 8k sequence a chip does not fit an H100 beside
           its share of the state: the preflight advises `context` = 4 for 8k, whose ring the GPU compiler takes
           over 10 minutes to compile 62 looped layers for), layers looped (the 62 do not repeat in whole periods
           of 6) and rematerialised.
Both:      bf16 compute, fp32 parameters and AdamW (lr 3e-4, b2 0.95, weight decay 0.1, clip 1.0), the loss in
           vocabulary chunks.
Command:   python -m experiments.lm.train --config=experiments/lm/configs/open_models.py:gpt_oss_120b --workdir=DIR
Preflight: python -m experiments.preflight --config=experiments/lm/configs/open_models.py:gpt_oss_120b --target=v5p-128 --noeval
           python -m experiments.preflight --config=experiments/lm/configs/open_models.py:gemma3_27b --target=h100-8 --noeval
Hardware:  gpt_oss_120b: v5p-128 (64 chips; its fp32 parameters and AdamW alone are 1.87 TB, more than an 8-GPU
           node holds): the preflight (2026-12-02) fits at 78.43 GiB of 95 GiB per chip; gemma3_27b: one node of 8
           H100s: the preflight (2026-12-02) fits at 62.32 GiB of 79.14 GiB per GPU (a v5p-16 does not: 102.87
           GiB). benchmarks/RESULTS.md ("The 2025-26 zoo").
Runtime:   not run on hardware.
Expected:  no published lm1b figure at these sizes.
`,runlocal` shrinks either to a CPU smoke run (a tiny model with the same features).
"""
from experiments.lm.configs import gpt2_small

VARIANTS = {
    "gpt_oss_120b": dict(preset="gpt_oss_120b", vocab_size=201_088, seq_len=4096, batch=512, chips=64, expert=8,
                         context=1, scan_layers=True),
    "gemma3_27b": dict(preset="gemma3_27b", vocab_size=262_208, seq_len=4096, batch=512, chips=8, expert=1,
                       context=1, scan_layers=False),
}
TINY = {  # runlocal: the same features at CPU size
    "gpt_oss_120b": dict(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2, d_ff=16, max_len=64,
                         num_experts=4, experts_per_token=2, sliding_window=8),
    "gemma3_27b": dict(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=6, d_ff=64, max_len=64,
                       sliding_window=8, attention_pattern=("local",) * 5 + ("global",)),
}
VOCAB_CHUNK = 16_384


def get_config(arg: str = "gpt_oss_120b"):
    variant, _, local = (arg or "gpt_oss_120b").partition(",")
    if variant == "runlocal":
        variant, local = "gpt_oss_120b", "runlocal"
    if variant not in VARIANTS or local not in ("", "runlocal"):
        raise ValueError(f"open_models.py:{arg}: choose {' or '.join(VARIANTS)} (optionally ,runlocal)")
    v = VARIANTS[variant]
    c = gpt2_small.get_config()
    c.model.preset = v["preset"]
    c.model.overrides = dict(execution=dict(dtype="bfloat16", attention_impl="auto", scan_layers=v["scan_layers"],
                                            remat_policy="full", moe_chunks=4 if v["expert"] > 1 else 1))
    c.vocab_size, c.seq_len = v["vocab_size"], v["seq_len"]
    c.task.vocab_chunk = VOCAB_CHUNK
    c.batch_size = v["batch"]
    c.microbatches = v["batch"] * v["context"] // v["chips"]
    c.optimizer.update(name="adamw", learning_rate=3e-4, warmup_steps=2000, schedule="cosine", weight_decay=0.1,
                       b2=0.95, clip_grad_norm=1.0)
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.context = 1, -1, v["expert"], v["context"]
    c.parallelism = "fsdp" + ("+expert" if v["expert"] > 1 else "") + ("+context" if v["context"] > 1 else "")
    if local:
        gpt2_small.shrink(c)
        c.model.overrides.update(TINY[variant], execution=dict(dtype="float32", attention_impl="xla",
                                                               remat_policy="none", scan_layers=False, moe_chunks=1))
        c.microbatches, c.mesh.expert, c.mesh.context, c.parallelism = 1, 1, 1, "fsdp"
    return c
