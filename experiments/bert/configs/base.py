"""BERT-base pretraining, MLM + NSP (Devlin et al. 2018, sections 3.1 and A.2).

Model: `bert_base` (position='learned', norm_position='post', activation='gelu', num_layers=12, d_model=768),
  MLM and NSP heads

Command (TPU v3-32 pod or 8 GPUs; on a pod, a workdir every worker sees: a gcsfuse mount):
  python -m experiments.bert.pretrain --config=experiments/bert/configs/base.py --workdir=/gcs/BUCKET/bert_base
Prerequisite: TFDS `wikipedia/20230601.en` prepared as array_record in --config.data_dir (needs
the `tf` extra); add BooksCorpus as plain text with --config.text_dirs=/path/to/books.
Hardware and time: the paper took 4 days on "4 Cloud TPUs in Pod configuration (16 TPU chips
total)"; not yet run with this code.
Expected: GLUE average 79.6 and SQuAD v1.1 dev F1 88.5 after fine-tuning (paper, Tables 1
and 2). MLPerf's pretraining target, held-out masked_lm_accuracy 0.720, is BERT-large's
(large.py); base ends below it.

The recipe: L12/H768/A12, post-norm, GELU, learned positions (512 from the start) and token
types, MLM head tied to the embeddings with transform and bias, NSP on the pooled [CLS];
WordPiece 30,522 uncased; batch 256; 1M steps, the first 900k at 128 tokens / 20
predictions, the last 100k at 512 / 80 (same run: step, Adam moments and schedule carry on);
Adam(W) lr 1e-4, betas (0.9, 0.999), eps 1e-6, weight decay 0.01 not on LayerNorm or biases,
10k linear warmup then linear decay to 0; gradient clipping at global norm 1.0 and dropout 0.1
as Google's code, whose AdamWeightDecayOptimizer has no bias correction
(`bias_correction=False`) and whose decay counts from step 0 (`schedule="bert_linear"`).
Masks are dynamic (a new draw per epoch) where the paper used 10 static copies.

`runlocal` (`--config=experiments/bert/configs/base.py:runlocal`) keeps every key and shrinks
sizes: a D-96, 2-layer model on the project's generated topical documents (4,000, 300 held
out), WordPiece 1,000, batch 64, 2,000 steps at 48 tokens / 8 predictions with the switch to
96 / 15 at step 1,800, peak lr 2e-3 after 400 warmup steps. Without bias correction, Adam's
steps over its first ~1/(1 - b2) = 1,000 updates are larger than the lr says (for a steady
gradient (1 - b1^t) / sqrt(1 - b2^t): 6.6x at step 12, 3.2x at 100, 1.3x at 1,000), which
the recipe's 10k warmup hides; with 100 warmup steps the same run ended at masked_lm 0.385
and next-sentence 0.646, with 400 as below. Measured (2-core CPU, ~5 min alone; 2026-11-24 with
the data streamed in chunks of 500 documents, 12 min on loaded cores): held-out masked_lm_accuracy 0.425
against the most-frequent-token baseline 0.268, next_sentence_accuracy 0.945. (The former
in-memory pipeline, NSP's random B from all 3,700 documents and another held-out set: 0.450,
baseline 0.285, next-sentence 0.926.)
"""
from experiments import common
from experiments.bert.settings import BertSettings
from tfm.train import MLMTask


def get_config(arg: str = ""):
    c = common.new_config(BertSettings, MLMTask)
    c.model.preset = "bert_base"
    # how, not what: the flash kernels (with the paper's attention dropout) on TPU and bf16/fp16 GPU,
    # xla elsewhere (tfm.ops.select); RESULTS.md's preflight rows
    c.model.overrides = dict(execution=dict(attention_impl="auto"))
    c.dataset = "wikipedia/20230601.en"  # TFDS; only a train split, held-out carved from it
    c.text_dirs = ""  # BooksCorpus stand-in: plain-text directories, comma-separated
    c.synthetic_documents = 0
    c.eval_documents = 10_000
    c.eval_batches = 100
    c.chunk_documents = 2_000  # ~6 MB of Wikipedia a chunk: instances made per chunk, streamed
    c.chunk_bytes = 8 << 20  # text_dirs: ~16 books a chunk
    c.shuffle_chunks = 8  # instances shuffled over 8 chunks at a time (~16k documents)
    c.data_workers = 0  # processes building the next windows (0: the training process); RESULTS.md, 2026-11-24
    c.vocab_documents = 200_000  # Google trained BERT's 30,522 WordPieces offline; vocab_path takes a file
    c.tokenizer = "wordpiece"  # uncased (lower-cased, accents stripped)
    c.vocab_size = 30_522
    c.max_seq_length = 128
    c.max_predictions_per_seq = 20
    c.masked_lm_prob = 0.15
    c.short_seq_prob = 0.1
    c.dupe_factor = 1  # pairs created once; masks drawn anew each epoch
    c.whole_word_masking = False
    c.next_sentence = True
    c.phase2_start_step = 900_000  # 90% of the steps at 128, 10% at 512
    c.phase2_max_seq_length = 512
    c.phase2_max_predictions_per_seq = 80
    c.phase2_batch_size = None  # same 256

    c.batch_size = 256
    c.num_train_steps = 1_000_000
    c.optimizer.update(name="adamw", learning_rate=1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                       decay_mask="kernels", bias_correction=False, schedule="bert_linear", warmup_steps=10_000,
                       end_lr_factor=0.0, clip_grad_norm=1.0)
    c.parallelism = "data"
    c.log_every = 100
    c.eval_every = 10_000
    c.checkpoint_every = 5_000
    c.keep_checkpoints = 3
    if arg == "runlocal":
        shrink(c)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use 'runlocal' or nothing")
    return c


def shrink(c) -> None:
    """`runlocal`: the same recipe and keys at CPU size on the generated corpus (~5 min alone)."""
    c.model.overrides.update(d_model=96, num_heads=4, num_layers=2, d_ff=384, max_len=96,
                             dropout_rate=0.0, attention_dropout=0.0)
    c.dataset, c.synthetic_documents, c.eval_documents, c.eval_batches = "synthetic_topics", 4000, 300, 4
    c.chunk_documents, c.shuffle_chunks, c.vocab_documents = 500, 4, 4000
    c.vocab_size = 1000
    c.max_seq_length, c.max_predictions_per_seq = 48, 8
    c.phase2_start_step, c.phase2_max_seq_length, c.phase2_max_predictions_per_seq = 1800, 96, 15
    c.batch_size, c.num_train_steps = 64, 2000
    c.optimizer.update(learning_rate=2e-3, warmup_steps=400)
    c.log_every, c.eval_every, c.checkpoint_every = 100, 1000, 1000
