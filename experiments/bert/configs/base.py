"""BERT-base pretraining, MLM + NSP (Devlin et al. 2018). Early version: values being filled in."""
from experiments import common
from experiments.bert.settings import BertSettings
from tfm.train import MLMTask


def get_config(arg: str = ""):
    c = common.new_config(BertSettings, MLMTask)
    c.model.preset = "bert_base"
    c.dataset = "wikipedia/20230601.en"
    c.text_dirs = ""
    c.synthetic_documents = 0
    c.eval_documents = 10_000
    c.eval_batches = 100
    c.tokenizer = "wordpiece"
    c.vocab_size = 30_522
    c.max_seq_length = 128
    c.max_predictions_per_seq = 20
    c.masked_lm_prob = 0.15
    c.short_seq_prob = 0.1
    c.dupe_factor = 1
    c.whole_word_masking = False
    c.next_sentence = True
    c.phase2_start_step = 900_000
    c.phase2_max_seq_length = 512
    c.phase2_max_predictions_per_seq = 80
    c.batch_size = 256
    c.num_train_steps = 1_000_000
    c.optimizer.update(name="adamw", learning_rate=1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                       decay_mask="kernels", schedule="linear", warmup_steps=10_000, clip_grad_norm=1.0)
    return c
