"""DeepSeek-V3 (DeepSeek-AI 2024; 671B parameters, 37B active per token) at its published shapes
(`tfm.models.presets.deepseek_v3`: 61 layers, D 7168, MLA, 3 dense layers then 256 routed experts
top-8 + 1 shared), trained on lm1b as a stand-in corpus: this recipe is for running tfm at the
paper's scale (sharding, memory, expert parallelism), not for reproducing DeepSeek-V3's quality.

Model: `deepseek_v3` (position='rope', num_layers=61, d_model=7168, num_experts=256, router_score='sigmoid'),
  latent attention (`mla`)

Command:   python -m experiments.lm.train --config=experiments/lm/configs/deepseek_v3.py --workdir=/gcs/BUCKET/lm/dsv3
Preflight: python -m experiments.preflight --config=experiments/lm/configs/deepseek_v3.py --target=v5p-1024 --noeval
Train:     4096 tokens, global batch 15360 sequences (the paper's batch after its ramp from
           3072; 63M tokens) in passes of one sequence per chip (microbatches = batch / chips);
           bf16 compute, fp32 parameters and AdamW (the paper's lr 2.2e-4, weight decay 0.1,
           b2 0.95, clip 1.0);
           FSDP over every chip and expert parallelism over `expert` = 8 (each chip sends its tokens
           to the experts' chips by all-to-all: `tfm.parallel.experts`); the MoE layers scanned,
           each layer rematerialised from its input, each chip's MoE tokens dispatched in
           `execution.moe_chunks` = 8 chunks of 512; the token table read where it lies
           (`execution.embedding_impl`), the loss over the vocabulary in chunks of 16384 columns
           (`task.vocab_chunk`: no [4096, V] fp32 logits); auxiliary-loss-free balancing (the bias).
Hardware:  v5p-1024 (fsdp 64 x expert 8, 30 microbatches), the smallest v5p slice on which it fits
           with room (compile-only preflight, 66% of HBM). On v5p-512 fp32 parameters and AdamW
           moments take 29.3 GiB of each chip's 95 and one pass's temporaries (the MoE layers' fp32
           gradient accumulators first) the rest: with whole sequences per chip it is over by a few
           GiB; with sequences split over 4 chips (context parallelism, 240 passes:
           --config.parallelism=fsdp+expert+context --config.mesh.context=4 --config.microbatches=240)
           it fits at 93%. Figures and commands: benchmarks/RESULTS.md ("Compile-only slices with
           their wraparound links").
Runtime:   not run on hardware.
Expected:  no published lm1b figure at this scale.
`:runlocal` shrinks it to a CPU smoke run (a tiny DeepSeek-V3: MLA, dense + routed + shared experts).
"""
from experiments.lm.configs import gpt2_small

CHIPS = 512          # chips the default microbatches assume (v5p-1024); elsewhere set microbatches = BATCH / chips
BATCH = 15_360       # sequences per step
EXPERT_SHARDS = 8    # mesh `expert` axis: the padded all-to-all buffers grow with it ([n, N*k, D])
MOE_CHUNKS = 8       # each chip's 4096 MoE tokens dispatched 512 at a time: buffers an eighth the size
VOCAB_CHUNK = 16_384  # the loss over the vocabulary in chunks of this many columns: no [T, V] fp32 logits
TINY_MOE = dict(d_model=32, num_heads=4, num_layers=3, d_ff=16, head_dim=16, max_len=64, dense_layers=1,
                dense_d_ff=64, num_experts=8, experts_per_token=2, router_groups=2, router_group_top=1,
                shared_expert_d_ff=16, mla=dict(kv_rank=16, rope_dim=8, q_rank=16, value_dim=8),
                rope=dict(original_max_len=32), dropout_rate=0.0, attention_dropout=0.0)


def get_config(arg: str = "", *, preset: str = "deepseek_v3", vocab_size: int = 129_280, batch: int = BATCH,
               chips: int = CHIPS, expert_shards: int = EXPERT_SHARDS, learning_rate: float = 2.2e-4):
    """The recipe; `preset` etc. let kimi_k2.py reuse it with its own shapes and batch."""
    c = gpt2_small.get_config()
    c.model.preset = preset
    c.model.overrides = dict(execution=dict(dtype="bfloat16", attention_impl="auto", scan_layers=True,
                                            remat_policy="full", moe_chunks=MOE_CHUNKS))
    c.vocab_size = vocab_size
    c.seq_len = 4096
    c.task.vocab_chunk = VOCAB_CHUNK
    c.batch_size = batch
    c.microbatches = batch // chips
    c.optimizer.update(name="adamw", learning_rate=learning_rate, warmup_steps=2000, schedule="cosine",
                       weight_decay=0.1, b2=0.95, clip_grad_norm=1.0)
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, -1, expert_shards
    c.parallelism = "fsdp+expert"
    if arg == "runlocal":
        gpt2_small.shrink(c)
        c.model.overrides.update(TINY_MOE, execution=dict(attention_impl="xla", remat_policy="none"))
        c.microbatches, c.mesh.expert = 1, 1
    elif arg:
        raise ValueError(f"{preset}.py:{arg}: the only argument is runlocal")
    return c
