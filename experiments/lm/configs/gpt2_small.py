"""GPT-2 small (124M) on lm1b, SentencePiece 32k vocabulary.

Command:   python -m experiments.lm.train --config=experiments/lm/configs/gpt2_small.py \
               --workdir=gs://BUCKET/lm/gpt2_small          (append :runlocal for a CPU smoke run)
Hardware:  TPU v4-32 or 8x H100, FSDP over all chips.
Runtime:   ~10 h for 100k steps of 256 x 256 tokens (not yet measured on this codebase).
Expected:  lm1b validation perplexity in the low 30s at 100k steps for a 124M model
           (Radford et al. report 35.8 zero-shot perplexity on lm1b for GPT-2 small; a model
           trained on lm1b itself does better). Not yet reproduced here.
"""
from experiments.lm.configs import tiny


def get_config(arg: str = ""):
    c = tiny.get_config()
    c.model = "gpt2_small"
    c.dataset = "lm1b"
    c.vocab_size = 32_000
    c.seq_len = 256
    c.batch_size = 256
    c.num_train_steps = 100_000
    c.optimizer.update(learning_rate=6e-4, warmup_steps=2000, weight_decay=0.1, b2=0.95)
    c.model_overrides.dtype = "bfloat16"
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.parallelism = "fsdp"
    c.log_every, c.eval_every, c.checkpoint_every = 100, 2000, 2000
    c.eval_batches = 50
    if arg == "runlocal":  # same recipe, CPU-sized: the tiny model on the local corpus
        c.update(tiny.get_config())
        c.num_train_steps = 20
    return c
