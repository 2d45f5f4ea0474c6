"""RoBERTa-base pretraining recipe (Liu et al. 2019) on the BERT code path: MLM only.

Model: `bert_base` (position='learned', norm_position='post', num_layers=12, d_model=768, type_vocab_size=1),
  the MLM head only

Command (TPU v3-128 or 8 GPUs):
  python -m experiments.bert.pretrain --config=experiments/bert/configs/roberta.py --workdir=/gcs/BUCKET/roberta
Differs from base.py where RoBERTa does: no NSP head, FULL-SENTENCES inputs (sentences packed
to 512 tokens across document boundaries, a separator between documents), dynamic masking
(a new mask every epoch), byte-level BPE 50k (cased), 512 tokens throughout (no phase 2),
batch 8k for 500k steps, peak lr 6e-4, 24k warmup, Adam beta2 0.98 (Liu et al. Table 9);
fairseq's Adam (bias-corrected) and linear decay from the end of warmup.
Hardware and time: the paper used 1024 V100s for a day over 160 GB of text; not run here.
Preflight (`python -m experiments.preflight --config=experiments/bert/configs/roberta.py
--target=h100-8`, compile-only, 2026-11-24): a step of 8k sequences needs 576 GiB per H100 in
one pass, so the recipe accumulates 16 microbatches of 512: 47.9 GiB of 79.1, fits.
Expected: GLUE and SQuAD above BERT-base (the paper's Table 8: SQuAD v1.1 F1 94.6 for large).
`roberta.py:runlocal` shrinks it on the generated corpus.
"""
from experiments.bert.configs import base


def get_config(arg: str = ""):
    c = base.get_config()
    c.model.overrides.update(heads=("mlm",), type_vocab_size=1)
    c.next_sentence = False
    c.tokenizer, c.vocab_size = "byte_bpe", 50_265
    c.max_seq_length, c.max_predictions_per_seq = 512, 80
    c.phase2_start_step = 0
    c.batch_size, c.num_train_steps = 8_192, 500_000
    c.microbatches = 16  # 512 sequences a pass: see the preflight above
    c.optimizer.update(learning_rate=6e-4, b2=0.98, eps=1e-6, warmup_steps=24_000, bias_correction=True,
                       schedule="linear")
    if arg == "runlocal":
        base.shrink(c)
        c.phase2_start_step, c.microbatches = 0, 1
        c.max_seq_length, c.max_predictions_per_seq = 96, 15
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use 'runlocal' or nothing")
    return c
