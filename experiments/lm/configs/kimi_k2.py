"""Kimi K2 (Moonshot AI 2025; about 1.04T parameters, 32B active per token): DeepSeek-V3's
architecture with 384 routed experts, 64 heads and one dense layer (`tfm.models.presets.kimi_k2`),
trained on lm1b as a stand-in corpus: for running tfm at this scale, not for reproducing K2.

Command:   python -m experiments.lm.train --config=experiments/lm/configs/kimi_k2.py --workdir=/gcs/BUCKET/lm/k2
Preflight: python -m experiments.preflight --config=experiments/lm/configs/kimi_k2.py --target=v5p-1024 --noeval
Train:     4096 tokens, global batch 16384 sequences (K2's 67M tokens per step) in passes of
           one sequence per chip (microbatches = batch / chips); bf16 compute, fp32 parameters and AdamW (K2 trained
           with MuonClip, which tfm does not have; lr 2e-4, weight decay 0.1); FSDP over every chip
           and expert parallelism over `expert` = 8; scanned MoE layers, full remat, each chip's MoE
           tokens dispatched in 4 chunks; see deepseek_v3.py.
Hardware:  v5p-1024 (fsdp 64 x expert 8, 32 microbatches), the smallest v5p slice on which it fits,
           with little room: preflight (2026-11-27, libtpu 0.0.42.1) 89.83 GiB per chip of 95 (95%):
           state 22.40 GiB, temporaries 67.40 GiB, since the params outside the experts are sharded
           over expert too (before: 92.49 GiB, state 24.20; RESULTS.md "FSDP collectives"); on
           2026-11-24 65.60 GiB of temporaries with 8 chunks, 95.45 GiB in all with one chunk. With
           room: v5p-2048 (128 x 8, `--config.microbatches=16`) 64.47 GiB (68%): state 12.10,
           temporaries 52.34. Collectives (v5p-2048) all-to-all x9 (5.31 GiB), all-gather x60,
           all-reduce x36, collective-permute x114; no MFU (XLA's cost model returned a negative
           time). The largest arrays left are the embedding table's f32[163840, 7168] (4.38 GiB,
           gathered and its gradient all-reduced whole). Before the chunked dispatch and the
           sharded MLA latent: refused on v5p-1024 (temporaries 108.93 G), 124.34 GiB on v5p-2048.
           Details: benchmarks/RESULTS.md ("DeepSeek-V3 and Kimi K2 train steps").
Runtime:   not run on hardware.
Expected:  no published lm1b figure at this scale.
`:runlocal` shrinks it to the same CPU smoke run as deepseek_v3.py:runlocal (with K2's vocabulary key).
"""
from experiments.lm.configs import deepseek_v3

CHIPS = 512  # chips the default microbatches assume (v5p-1024); elsewhere set microbatches = 16384 / chips


def get_config(arg: str = ""):
    return deepseek_v3.get_config(arg, preset="kimi_k2", vocab_size=163_840, batch=16_384, chips=CHIPS,
                                  learning_rate=2e-4)
