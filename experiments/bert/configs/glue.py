"""BERT fine-tuning on one GLUE task (Devlin et al. 2018, section 4.1): max_seq_length 128,
batch 32, 3 epochs, learning rate picked on dev from {5,4,3,2}e-5 (--sweep).

Model: from the checkpoint (`--init`): its ModelConfig, the MLM and NSP heads dropped, the pooler kept, a new
  task head

Command:   python -m experiments.bert.finetune --config=experiments/bert/configs/glue.py:rte \\
               --init=DIR --workdir=/tmp/ft/rte --sweep
           (task: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte)
Hardware:  one GPU or TPU host (run time not measured yet: no accelerator so far); RTE is 233
           steps per learning rate (2.5k examples), MNLI 36.8k (393k).
Expected:  the paper's dev-set-selected test scores (Table 1), BERT-base / BERT-large:
           MNLI-m/mm 84.6/83.4 / 86.7/85.9, QQP F1 71.2 / 72.1, QNLI 90.5 / 92.7,
           SST-2 93.5 / 94.9, CoLA 52.1 / 60.5, STS-B Spearman 85.8 / 86.5, MRPC F1 88.9 / 89.3,
           RTE 66.4 / 70.1; GLUE average 79.6 / 82.1. Dev scores are reported here (the test
           labels are not public).
Data:      TFDS glue/<task>, prepared once as array_record (see README).

`runlocal` (any TASK: `glue.py:rte,runlocal`) keeps the recipe's keys and code path at CPU size,
offline: the generated `synthetic_topic_pairs` (`tfm.data.synthetic.topic_pairs`, written to
<workdir>/data as array_record like pretraining's corpus, read as GLUE is): is the sentence pair on
one topic of `configs/base.py:runlocal`'s corpus (label 1) or on two (0)? Balanced; 128 training
pairs, all 500 dev pairs, 48 tokens, 5 epochs of batch 16 (40 steps), lr 3e-4 (sweep 1e-3, 3e-4).
    python -m experiments.bert.pretrain --config=experiments/bert/configs/base.py:runlocal --workdir=/tmp/bert
    python -m experiments.bert.finetune --config=experiments/bert/configs/glue.py:rte,runlocal \\
        --init=/tmp/bert --workdir=/tmp/bert_ft
Measured (2-core CPU shared with other jobs: 42 s; init: a base.py:runlocal workdir after its
2,000 steps, held-out masked_lm 0.430, next_sentence 0.918), dev accuracy over seeds 0, 1, 2,
against the same model, tokenizer and recipe from a random init (chance: 50):
    lr 3e-4, 128 pairs:  pretrained 89.2, 91.4, 92.4 (mean 91.0)   scratch 53.4, 52.0, 51.8 (52.4)
    lr 1e-3, 128 pairs:  pretrained 88.8, 89.0, 90.6 (89.5)        scratch 50.0, 50.0, 50.0
    all 1,000 pairs (312 steps), seed 0: pretrained 93.0 (lr 3e-4), 92.2 (1e-3); scratch 49.2, 50.0
From scratch the model learns nothing here even from all 1,000 pairs: what the pretrained one
knows (which words share a topic) comes from next-sentence prediction on the topical corpus.
"""
from experiments.bert import finetune
from experiments.bert.glue import task_of


def get_config(arg: str = "rte"):
    task, *flags = [a.strip() for a in arg.split(",")]
    name, _ = task_of(task)
    unknown = set(flags) - {"runlocal"}
    if unknown:
        raise ValueError(f"glue.py config: unknown option(s) {sorted(unknown)}; use 'TASK' or 'TASK,runlocal'")
    c = finetune.base_config(f"glue/{name}", max_seq_length=128, learning_rate=2e-5)
    return runlocal(c) if flags else c


def runlocal(c):
    """The recipe at CPU size on the generated topic-pair task (module doc), whichever TASK."""
    finetune.runlocal(c)
    c.update(dataset="synthetic_topic_pairs", max_seq_length=48, max_train_examples=128, max_eval_examples=0,
             num_epochs=5.0, batch_size=16, learning_rates="1e-3,3e-4", log_every=10)
    c.optimizer.learning_rate = 3e-4
    return c
