"""Llama-2-shaped decoders at scale: `:7b` (default) and `:70b` (Touvron et al. 2023, Table 1
shapes: D 4096 / 8192, 32 / 80 layers, 32 / 64 heads, MHA / 8 kv heads, F 11008 / 28672,
4096 tokens, V 32000), trained on lm1b as a stand-in corpus: these recipes are for running
tfm at the paper's scale (sharding, memory, kernels), not for reproducing Llama-2's quality.

Model: `llama` (position='rope', rope.theta=10000.0, activation='swiglu', num_layers=32, d_model=4096,
  num_kv_heads=32)

Command:   python -m experiments.lm.train --config=experiments/lm/configs/llama2.py:7b --workdir=/gcs/BUCKET/lm/llama2_7b
Preflight: python -m experiments.preflight --config=experiments/lm/configs/llama2.py:7b --target=v5p-512
Hardware:  7b: TPU v5p-512 (256 chips) or 8 nodes of 8 H100s (h100-64); 70b: TPU v5p-1024 (512 chips)
           or 32 nodes of 8 H100s (h100-256). FSDP over every chip, layers scanned and
           rematerialised (7b keeps the matmul outputs, 70b only each layer's input), bf16
           compute with fp32 parameters and Adam.
           Preflight (libtpu 0.0.42.1, jax-cuda12-pjrt 0.10.2): 7b fits v5p-512 at 12.83 GiB per
           chip (0.29 params + Adam; 2026-11-27, the slice's wraparound links modelled) and h100-64
           at 48.40 GiB; 70b fits h100-256 at 31.60 GiB;
           the estimated steps and MFU (flash kernels counted), v5p-1024 and the rest in
           benchmarks/RESULTS.md.
`:long`:   the 7b at 32,768 tokens with RoPE base 500,000, the shape of Llama-2-Long's continued
           pretraining (Xiong et al. 2023, "Effective Long-Context Scaling of Foundation
           Models"), 64 sequences (2M tokens) per step, context parallelism: mesh fsdp x context 4
           (parallelism fsdp+context), ring attention (each device holds 8k tokens of a sequence:
           two mirrored 4k chunks; K/V blocks passed around the ring), parameters and Adam split
           over fsdp x context.
    python -m experiments.preflight --config=experiments/lm/configs/llama2.py:long --target=v5p-512
    python -m experiments.preflight --config=experiments/lm/configs/llama2.py:long --target=h100-8 --config.microbatches=32
           (8 H100s: fsdp 2 x context 4, 2 rows of 32k per pass as on v5p, 32 passes per step.)
           Preflight (2026-11-27, v5p-512 with its wraparound links): fits, 26.61 GiB per chip
           (0.29 GiB params + Adam, 26.32 GiB temporaries), attention the ring with the Pallas flash
           kernels (Mosaic) per block (impl auto; per device [1, 32, 4096, 128] runs with their
           position offset), 40 collective-permutes (the ring's K/V blocks, the zig-zag re-layout);
           no step time (the ring's kernels sit in a loop the estimate cannot scale: refused). The
           chunked backend per block (--config.model.overrides.execution.attention_impl=chunked)
           took 64.20 GiB on 2026-11-24 (before the links were modelled).
           Preflight (2026-11-24, h100-8): fits, 40.27 GiB of 79.14 GiB per GPU (9.41 GiB params +
           Adam, 30.84 GiB temporaries; the Triton flash kernels per block), 39 collective-permutes,
           20 all-gathers, 6 reduce-scatters; 188 s (chunked blocks: 60.34 GiB). Without context
           parallelism (--config.mesh.context=1 --config.microbatches=8: fsdp 8, one whole 32k row
           per GPU, the flash kernels) it needs 106.99 GiB per GPU and does not fit; on v5p-512 a
           whole 32k row per chip (--config.mesh.context=1 --config.batch_size=256)
           needed 96.69 GiB of 95 GiB (2026-11-24, before the links). benchmarks/RESULTS.md has the rest.
Runtime:   not run on hardware yet.
Expected:  no published lm1b figure at this scale; the loss must fall below the 160M llama.py's.
`:runlocal` shrinks either to a CPU smoke run on the generated corpus.
"""
from experiments.lm.configs import gpt2_small

SHAPES = {"7b": dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, d_ff=11008),
          "70b": dict(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, d_ff=28672)}
# 70b saves only each layer's input: its matmul outputs, kept for the backward as 7b's are, would
# take 108 GiB per v5p chip and 229 GiB per H100 (preflight)
REMAT = {"7b": "dots_with_no_batch_dims_saveable", "70b": "full"}
LONG_TOKENS, LONG_CONTEXT = 32_768, 4  # `:long`: each device holds 32k / 4 = 8k tokens of a sequence


def get_config(arg: str = "7b"):
    variant, _, local = (arg or "7b").partition(",")
    if variant == "runlocal":
        variant, local = "7b", "runlocal"
    size = "7b" if variant == "long" else variant
    if size not in SHAPES:
        raise ValueError(f"llama2.py:{arg}: choose 7b, 70b or long (optionally ,runlocal)")
    c = gpt2_small.get_config()
    c.model.preset = "llama"
    c.model.overrides = dict(SHAPES[size], max_len=4096, rope=dict(theta=10_000.0),
                             execution=dict(dtype="bfloat16", attention_impl="auto", scan_layers=True,
                                            remat_policy=REMAT[size]))
    c.seq_len = 4096
    c.batch_size = 256 if size == "7b" else 1024  # 1M / 4M tokens per step (Llama-2: 4M)
    c.optimizer.update(name="adamw", learning_rate=3e-4, warmup_steps=2000, schedule="cosine",
                       weight_decay=0.1, b2=0.95)
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.parallelism = "fsdp"
    if variant == "long":  # Llama-2-Long's continued pretraining shape: 32k tokens, RoPE base 500k
        c.model.overrides.update(max_len=LONG_TOKENS, rope=dict(theta=500_000.0))
        c.seq_len = LONG_TOKENS
        c.batch_size = 64  # 2M tokens per step
        c.mesh.context = LONG_CONTEXT
        c.parallelism = "fsdp+context"
    if local == "runlocal":
        gpt2_small.shrink(c)
        c.model.overrides.update(num_kv_heads=4, execution=dict(attention_impl="xla", remat_policy="none"))
        c.mesh.context = 1  # one CPU device: the sequence stays whole
    return c
