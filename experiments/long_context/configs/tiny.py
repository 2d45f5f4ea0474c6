"""A 2-layer encoder (D 32, 2 heads) classifying generated 512-token documents by their one needle token, with each
efficient-attention variant of tfm as a config value (CPU, no downloads).

Model: `tiny_encoder` (position='learned', norm_position='post', num_layers=2, d_model=32, num_heads=2), a
  classification head; each variant adds its attention fields

Command:   python -m experiments.long_context.train --config=experiments/long_context/configs/tiny.py:VARIANT --workdir=DIR
           python -m experiments.long_context.compare --workdir=DIR   # every variant, one table and plot
Variants:  full        full attention (the reference)
           window      sliding_window=32 on both layers: position 0 sees positions <= 2 * 31 = 62 only
           longformer  attention_sparsity Longformer: the same window, plus token 0 (CLS) global
           bigbird     attention_sparsity BigBird: blocks of 32, window 1 block, 1 global block, 1 random block
           strided     attention_sparsity Sparse Transformer strided, stride 32
           linformer   linformer_length=64: keys and values projected along the length, 512 -> 64
           value_rank  value_rank=8: W_V [32, 32] factorised as [32, 8] [8, 32], attention full
           Any of them may add ",runlocal": the recipe is CPU-sized already, so it changes nothing.
Hardware:  one CPU; 150 steps at L 512 took 5-7 minutes per variant on 2 cores shared with other jobs
           (full attention is at 100% held-out by step 100).
Expected:  see experiments/long_context/README.md (measured held-out accuracy of every variant).
"""
from experiments import common
from experiments.long_context import documents
from experiments.long_context.settings import LongContextSettings
from tfm.train import ClassificationTask

LENGTH = 512
LAYERS = 2
WINDOW = 32
MODEL = dict(d_model=32, num_heads=2, num_layers=LAYERS, d_ff=64, max_len=LENGTH, heads=("classification",),
             num_labels=len(documents.NEEDLES), type_vocab_size=0)
VARIANTS = {
    "full": {},
    "window": dict(sliding_window=WINDOW),
    "longformer": dict(attention_sparsity=dict(kind="longformer", window=WINDOW, globals=1)),
    "bigbird": dict(attention_sparsity=dict(kind="bigbird", block=WINDOW, window=1, globals=1, random=1)),
    "strided": dict(attention_sparsity=dict(kind="strided", stride=WINDOW)),
    "linformer": dict(linformer_length=64),
    "value_rank": dict(value_rank=8),
}


def get_config(arg: str = "full"):
    variant = ",".join(part for part in arg.split(",") if part != "runlocal") or "full"
    if variant not in VARIANTS:
        raise ValueError(f"long_context config variant {variant!r} unknown; choose from {sorted(VARIANTS)} "
                         "(each may add ',runlocal')")
    c = common.new_config(LongContextSettings, ClassificationTask)
    c.model.preset = "tiny_encoder"
    c.model.overrides = {**MODEL, **VARIANTS[variant]}
    c.length = LENGTH
    c.train_documents = 100_000
    c.eval_documents = 256
    c.near = documents.reach(LAYERS, WINDOW)
    c.batch_size = 16
    c.num_train_steps = 150
    c.optimizer.update(name="adamw", learning_rate=1e-3, warmup_steps=15, schedule="cosine", weight_decay=0.01)
    c.log_every = 50
    c.eval_every = 150
    c.checkpoint_every = 150
    return c
