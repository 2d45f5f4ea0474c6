"""Kimi K2 (Moonshot AI 2025; about 1.04T parameters, 32B active per token): DeepSeek-V3's
architecture with 384 routed experts, 64 heads and one dense layer (`tfm.models.presets.kimi_k2`),
trained on lm1b as a stand-in corpus: for running tfm at this scale, not for reproducing K2.

Model: `kimi_k2` (position='rope', num_layers=61, d_model=7168, num_heads=64, num_experts=384), latent
  attention (`mla`)

Command:   python -m experiments.lm.train --config=experiments/lm/configs/kimi_k2.py --workdir=/gcs/BUCKET/lm/k2
Preflight: python -m experiments.preflight --config=experiments/lm/configs/kimi_k2.py --target=v5p-1024 --noeval
Train:     4096 tokens, global batch 16384 sequences (K2's 67M tokens per step) in passes of
           one sequence per chip (microbatches = batch / chips); bf16 compute, fp32 parameters and AdamW (K2 trained
           with MuonClip, which tfm does not have; lr 2e-4, weight decay 0.1); FSDP over every chip
           and expert parallelism over `expert` = 8; scanned MoE layers, full remat, each chip's MoE
           tokens dispatched in 8 chunks, the loss in vocabulary chunks; see deepseek_v3.py.
Hardware:  v5p-1024 (fsdp 64 x expert 8, 32 microbatches), the smallest v5p slice on which it fits,
           with more than 10% of each chip's HBM free (compile-only preflight). Figures and commands:
           benchmarks/RESULTS.md ("Compile-only slices with their wraparound links").
Runtime:   not run on hardware.
Expected:  no published lm1b figure at this scale.
`:runlocal` shrinks it to the same CPU smoke run as deepseek_v3.py:runlocal (with K2's vocabulary key).
"""
from experiments.lm.configs import deepseek_v3

CHIPS = 512  # chips the default microbatches assume (v5p-1024); elsewhere set microbatches = 16384 / chips


def get_config(arg: str = ""):
    return deepseek_v3.get_config(arg, preset="kimi_k2", vocab_size=163_840, batch=16_384, chips=CHIPS,
                                  learning_rate=2e-4)
