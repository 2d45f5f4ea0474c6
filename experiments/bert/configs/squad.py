"""BERT fine-tuning on SQuAD v1.1 (Devlin et al. 2018, section 4.2): max_seq_length 384,
doc stride 128, question 64 tokens, batch 32, 3 epochs at learning rate 5e-5; answers of at
most 30 tokens from the 20 best starts and ends, read back from the context's characters.

Model: from the checkpoint (`--init`): its ModelConfig, the MLM and NSP heads dropped, a new span head

Command:   python -m experiments.bert.finetune --config=experiments/bert/configs/squad.py \\
               --init=DIR --workdir=/tmp/ft/squad
           (":runlocal" shrinks it for a CPU: 64 training and 16 dev questions, one epoch)
Hardware:  one GPU or TPU host (run time not measured yet); ~88k training windows, ~8.2k steps.
Expected:  dev EM/F1 80.8/88.5 (BERT-base), 84.1/90.9 (BERT-large), Table 2 of the paper.
Data:      TFDS squad/v1.1, prepared once as array_record (see README).
"""
from experiments.bert import finetune


def get_config(arg: str = ""):
    if arg not in ("", "runlocal"):
        raise ValueError(f"squad.py config: unknown option {arg!r}; use '' or 'runlocal'")
    c = finetune.base_config("squad", max_seq_length=384, learning_rate=5e-5)
    return finetune.runlocal(c) if arg else c
