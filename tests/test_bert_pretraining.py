"""BERT pretraining experiment: whole-word masking, the input layout against Hugging Face's
tokenizer, the 128 -> 512 phase switch, the paper's configs, the wikipedia path on mock data.

The masking and NSP statistics over >= 10k examples are in tests/test_data_pretraining.py.
"""
import collections
import dataclasses
import json
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import tfds_mock
from experiments.bert import pretrain
from experiments.bert.configs import base, large, roberta
from experiments import common
from experiments.bert.settings import BertSettings
from test_train_units import bert_learning_rate
from tfm import parallel
from tfm.data import documents, pretraining, sources, streaming, synthetic, tokenizers
from tfm.models import EncoderModel, presets
from tfm.train import MLMTask


@pytest.fixture(scope="module")
def docs():
    return synthetic.topical_documents(120, seed=3, min_sentences=4, max_sentences=9)


@pytest.fixture(scope="module")
def wordpiece(docs, tmp_path_factory):
    """A small vocabulary, so that many words split into several pieces."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    return tokenizers.train_wordpiece([s for d in docs for s in d], 90, path=path), path


def _rows(docs, tok, n_batches, **kw):
    ds = pretraining.pretraining_dataset(docs, tok, batch_size=64, max_seq_length=64,
                                         max_predictions_per_seq=20, num_epochs=1, **kw)
    return [b for _, b in zip(range(n_batches), ds)]


def _originals(b):
    """input_ids with the predicted tokens put back: the unmasked rows [B, L]."""
    ids = b["input_ids"].copy()
    for row in range(len(ids)):
        k = b["mlm_weights"][row].sum()
        ids[row, b["mlm_positions"][row][:k]] = b["mlm_ids"][row][:k]
    return ids


def _split_words(b, continuation, sep_id):
    """For each row, (masked position set, list of words as position arrays of >= 1 piece)."""
    ids = _originals(b)
    for row in range(len(ids)):
        k = b["mlm_weights"][row].sum()
        masked = set(b["mlm_positions"][row][:k].tolist())
        n = b["attention_mask"][row].sum()
        words, current = [], []
        for pos in range(1, n - 1):
            if ids[row, pos] == sep_id:  # a '##' piece right after [SEP] starts a (truncated) word
                continue
            if ids[row, pos] in continuation and current and current[-1] == pos - 1:
                current.append(pos)
            else:
                if current:
                    words.append(current)
                current = [pos]
        words.append(current)
        yield masked, words


@pytest.mark.parametrize("whole_word", [True, False])
def test_whole_word_masking_never_splits_a_word(docs, wordpiece, whole_word):
    """With whole-word masking every word (a token and its following ## pieces) is predicted
    whole or not at all, and multi-piece words are predicted; without it, some are split
    (so the check can fail). The 80/10/10 draw stays per piece."""
    tok, _ = wordpiece
    continuation = set(tok.continuation_ids)
    batches = _rows(docs, tok, 4, whole_word_masking=whole_word, seed=0)
    split = multi = 0
    for b in batches:
        for masked, words in _split_words(b, continuation, tok.sep_id):
            for w in words:
                hit = sum(p in masked for p in w)
                split += 0 < hit < len(w)
                multi += hit == len(w) > 1
    if whole_word:
        assert split == 0 and multi > 50
        predicted = sum(int(b["mlm_weights"].sum()) for b in batches)
        unchanged = sum(int((b["input_ids"][r][b["mlm_positions"][r][:k]] == b["mlm_ids"][r][:k]).sum())
                        for b in batches for r in range(len(b["input_ids"]))
                        for k in [b["mlm_weights"][r].sum()])
        assert predicted > 1000
        assert 0.05 < unchanged / predicted < 0.2  # ~10% (+ 1/85 random hits): drawn per piece
    else:
        assert split > 20


def test_layout_matches_hugging_face_tokenizer(docs, wordpiece):
    """[CLS] A [SEP] B [SEP], token types 0 then 1, attention mask, zero padding: each row with
    its predicted tokens restored equals Hugging Face BertTokenizer's encoding of the pair's text."""
    from transformers import BertTokenizer  # transformers 5: the fast tokenizer, vocab= a vocab.txt path
    tok, path = wordpiece
    hf = BertTokenizer(vocab=str(path), do_lower_case=True)
    checked = 0
    for b in _rows(docs, tok, 2, seed=1):
        ids = _originals(b)
        for row in range(len(ids)):
            n = b["attention_mask"][row].sum()
            first_sep = int(np.flatnonzero(ids[row] == tok.sep_id)[0])
            a, second = ids[row, 1:first_sep], ids[row, first_sep + 1:n - 1]
            if a[0] in tok.continuation_ids or second[0] in tok.continuation_ids:
                continue  # a truncated pair may start with a '##' piece: no text encodes to that
            enc = hf(tok.decode(a), tok.decode(second), padding="max_length", max_length=64)
            np.testing.assert_array_equal(ids[row], enc["input_ids"])
            np.testing.assert_array_equal(b["token_type_ids"][row], enc["token_type_ids"])
            np.testing.assert_array_equal(b["attention_mask"][row], enc["attention_mask"])
            checked += 1
    assert checked > 40  # of 128 rows; the rest begin a segment mid-word


def test_full_sentences_layout(docs, wordpiece):
    """RoBERTa FULL-SENTENCES: [CLS] tokens [SEP], type 0, no NSP label; every row is a run of
    whole consecutive sentences, with [SEP] where one document ends and the next begins."""
    tok, _ = wordpiece
    tokenized = [[tok.encode(s) for s in d] for d in docs]
    stream = []
    for d, doc in enumerate(tokenized):
        stream += ([tok.sep_id] if d else []) + [t for s in doc for t in s]
    rows = pretraining.create_full_sentence_instances(tokenized, max_seq_length=64,
                                                      separator_id=tok.sep_id, seed=0)
    assert all(b == [] and label == -1 and 1 <= len(a) <= 62 for a, b, label in rows)
    text = " ".join(map(str, stream))
    assert all(" ".join(map(str, a)) in text for a, _, _ in rows)
    packed = collections.Counter(t for a, _, _ in rows for t in a)
    whole = collections.Counter(stream)
    assert packed[tok.sep_id] <= whole.pop(tok.sep_id)  # a separator opening a row is dropped
    packed.pop(tok.sep_id, None)
    assert packed == whole  # every other token exactly once
    assert any(tok.sep_id in a for a, _, _ in rows)  # rows cross document boundaries
    batch = _rows(docs, tok, 1, next_sentence=False)[0]
    assert "nsp_label" not in batch and not batch["token_type_ids"].any()
    n = batch["attention_mask"].sum(1)
    assert (batch["input_ids"][:, 0] == tok.cls_id).all()
    assert (batch["input_ids"][np.arange(64), n - 1] == tok.sep_id).all()


def _tiny_config(tmp, **changes):
    c = base.get_config("runlocal")
    c.model.overrides.update(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=64)
    c.synthetic_documents, c.eval_documents, c.eval_batches, c.vocab_size = 150, 20, 1, 120
    c.max_seq_length, c.max_predictions_per_seq, c.phase2_start_step = 32, 5, 0
    c.phase2_max_seq_length, c.phase2_max_predictions_per_seq = 64, 10
    c.batch_size, c.data_dir = 8, str(tmp / "data")
    c.optimizer.update(learning_rate=1e-2, warmup_steps=2, decay_steps=6)
    c.log_every, c.eval_every, c.checkpoint_every, c.keep_checkpoints = 1, 0, 1, 10
    c.async_checkpoint, c.progress_bar = False, False
    for key, value in changes.items():
        c[key] = value
    return c


def _saved(workdir, step):
    """(adam mu, adam nu, data state) of checkpoint `step`, read back raw."""
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))
    leaves = jax.tree_util.tree_flatten_with_path(tree["opt_state"])[0]
    moments = {name: np.concatenate([np.ravel(x) for p, x in leaves if name in map(str, (getattr(k, "key", k) for k in p))])
               for name in ("mu", "nu")}
    with open(os.path.join(workdir, "checkpoints", str(step), "data", "process_0-of-1.json")) as f:
        return moments["mu"], moments["nu"], json.load(f)


def _check_moments_carry(before, after, b1=0.9, b2=0.999):
    """One Adam step continued from `before`'s moments: mu' = b1 mu + (1-b1) g and
    nu' = b2 nu + (1-b2) g^2 for the same gradient g. Moments re-initialised to zero
    would give mu' = (1-b1) g, which fails this since mu is not zero."""
    mu0, nu0, _ = before
    mu1, nu1, _ = after
    assert np.abs(mu0).max() > 1e-4
    g = (mu1 - b1 * mu0) / (1 - b1)
    np.testing.assert_allclose((nu1 - b2 * nu0) / (1 - b2), g ** 2, rtol=2e-2, atol=1e-4 * np.max(g ** 2))


def _train_lrs(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["lr"] for r in map(json.loads, f) if r["split"] == "train"}


def test_phase_switch_in_one_run(tmp_path):
    """phase2_start_step=2: steps 1-2 at 32 tokens, step 3 at 64; the step, the schedule and
    Adam's moments run on across the switch. Then the same workdir under a changed
    max_seq_length (phase 2 as a second command) is accepted and the change recorded."""
    workdir, one_device = str(tmp_path / "run"), parallel.make_mesh(devices=jax.devices()[:1])
    config = _tiny_config(tmp_path, phase2_start_step=2, num_train_steps=3, checkpoint_every=2)
    result = pretrain.train_and_evaluate(config, workdir, mesh=one_device)
    assert result["step"] == 3 and set(pretrain.METRICS) <= set(result)
    assert 0 < result["baseline_masked_lm_accuracy"] < 1
    before, after = _saved(workdir, 2), _saved(workdir, 3)
    assert before[2]["phase"]["max_seq_length"] == 32 and after[2]["phase"]["max_seq_length"] == 64
    assert (before[2]["drawn"], after[2]["drawn"]) == (2, 3)
    _check_moments_carry(before, after)
    lrs = _train_lrs(workdir)
    assert sorted(lrs) == [1, 2, 3]
    for step, lr in lrs.items():  # logged at the step's start: schedule(step - 1)
        assert lr == pytest.approx(bert_learning_rate(step - 1, peak=1e-2, warmup=2, total=6), rel=1e-5)

    changed = _tiny_config(tmp_path, phase2_start_step=0, num_train_steps=3, max_seq_length=64)
    assert pretrain.train_and_evaluate(changed, workdir, mesh=one_device)["step"] == 3  # restored, not refused
    with open(os.path.join(workdir, "config.step3.json")) as f:
        recorded = json.load(f)
    assert (recorded["max_seq_length"], recorded["phase2_start_step"]) == (64, 0)


class _Counter:
    """A checkpointable stand-in for a phase's batch iterator: yields (phase length, i)."""

    def __init__(self, phase):
        self.phase, self.i = phase, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return self.phase.max_seq_length, self.i - 1

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def test_phased_batches_state():
    """The stream switches at the step; a saved state resumes it within the same phase, and a
    state of another shape (phase 2 started as a second command) starts that phase afresh."""
    short, long = pretrain.Phase(32, 5, 8), pretrain.Phase(64, 10, 8)
    stream = pretrain.PhasedBatches(_Counter, short, long, switch=3)
    assert [next(stream) for _ in range(5)] == [(32, 0), (32, 1), (32, 2), (64, 0), (64, 1)]
    resumed = pretrain.PhasedBatches(_Counter, short, long, switch=3)
    resumed.set_state(json.loads(json.dumps(stream.get_state())))
    assert next(resumed) == (64, 2) and resumed.drawn == 6
    early = pretrain.PhasedBatches(_Counter, short, long, switch=3)
    [next(early) for _ in range(2)]
    one_phase = pretrain.PhasedBatches(_Counter, long, None, switch=None)
    one_phase.set_state(early.get_state())
    assert next(one_phase) == (64, 0) and one_phase.drawn == 3


PAPER_TRAINING = dict(batch_size=256, num_train_steps=1_000_000, phase2_start_step=900_000,
                      max_seq_length=128, max_predictions_per_seq=20, phase2_max_seq_length=512,
                      phase2_max_predictions_per_seq=80, masked_lm_prob=0.15, short_seq_prob=0.1,
                      vocab_size=30_522, tokenizer="wordpiece", next_sentence=True)
PAPER_OPTIMIZER = dict(name="adamw", learning_rate=1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                       decay_mask="kernels", bias_correction=False, schedule="bert_linear", warmup_steps=10_000,
                       end_lr_factor=0.0)


@pytest.mark.parametrize("module,size", [(base, "base"), (large, "large")])
def test_configs_hold_the_papers_values(module, size):
    """Field by field against Devlin et al. (training) and Hugging Face's BertConfig (the
    model), built with eval_shape: the parameter count equals BertForPreTraining's own."""
    import torch
    from transformers import BertConfig, BertForPreTraining
    config = module.get_config()
    exp = common.resolve(config, BertSettings, MLMTask)
    for key, value in PAPER_TRAINING.items():
        assert config[key] == value, key
    for key, value in PAPER_OPTIMIZER.items():
        assert getattr(exp.train.optimizer, key) == value, key
    dims = dict(base=(768, 12, 12, 3072), large=(1024, 24, 16, 4096))[size]
    hf = BertConfig(hidden_size=dims[0], num_hidden_layers=dims[1], num_attention_heads=dims[2],
                    intermediate_size=dims[3])
    m = exp.model(30_522)
    assert (m.d_model, m.num_layers, m.num_heads, m.d_ff) == dims
    assert (m.max_len, m.type_vocab_size, m.norm_eps) == (hf.max_position_embeddings, hf.type_vocab_size,
                                                           hf.layer_norm_eps)
    assert m.activation == hf.hidden_act == "gelu"
    assert m.dropout_rate == hf.hidden_dropout_prob and m.attention_dropout == hf.attention_probs_dropout_prob
    assert (m.norm_position, m.position, m.tie_embeddings, m.output_bias, m.embedding_norm) == (
        "post", "learned", True, True, True)
    assert m.heads == ("mlm", "nsp")
    batch = dict(input_ids=np.zeros((1, 128), np.int32), token_type_ids=np.zeros((1, 128), np.int32),
                 attention_mask=np.ones((1, 128), np.int32), mlm_positions=np.zeros((1, 20), np.int32),
                 mlm_ids=np.zeros((1, 20), np.int32), mlm_weights=np.ones((1, 20), np.int32),
                 nsp_label=np.zeros((1,), np.int32))
    shapes = jax.eval_shape(lambda: MLMTask().init_variables(EncoderModel(m), jax.random.PRNGKey(0), batch))
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
    with torch.device("meta"):
        theirs = sum(p.numel() for p in BertForPreTraining(hf).parameters())
    assert ours == theirs
    if size == "base":
        assert theirs == 110_106_428


def test_weight_decay_skips_layernorm_and_biases():
    """AdamW with zero gradients moves a parameter only by decay: every kernel and embedding
    shrinks by lr * 0.01, LayerNorm scales/biases and every bias stay put."""
    from tfm.train.optim import make_optimizer
    exp = common.resolve(base.get_config(), BertSettings, MLMTask)
    opt = dataclasses.replace(exp.train.optimizer, warmup_steps=0, schedule="constant", learning_rate=0.5)
    tx, _ = make_optimizer(opt, 10)
    cfg = presets.tiny("encoder")
    batch = dict(input_ids=np.ones((1, 8), np.int32), token_type_ids=np.zeros((1, 8), np.int32),
                 attention_mask=np.ones((1, 8), np.int32), mlm_positions=np.zeros((1, 2), np.int32),
                 mlm_ids=np.zeros((1, 2), np.int32), mlm_weights=np.ones((1, 2), np.int32),
                 nsp_label=np.zeros((1,), np.int32))
    import flax.linen as nn
    init = jax.jit(lambda: MLMTask().init_variables(EncoderModel(cfg), jax.random.PRNGKey(0), batch)["params"])
    params = nn.unbox(init())
    params = jax.tree.map(lambda p: p + 1.0, params)  # no zeros, so decay always shows

    @jax.jit
    def one_step(params):
        updates, _ = tx.update(jax.tree.map(jax.numpy.zeros_like, params), tx.init(params), params)
        return optax.apply_updates(params, updates)

    new = one_step(params)
    decayed, kept = [], []
    for (path, p), q in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new)):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if np.allclose(q, p * (1 - 0.5 * 0.01), rtol=1e-6):
            decayed.append(name)
        else:
            np.testing.assert_array_equal(q, p, err_msg=name)
            kept.append(name)
    assert decayed and kept
    assert all(n.endswith(("kernel", "embedding")) for n in decayed), decayed
    assert all(n.endswith(("bias", "scale")) for n in kept), kept
    assert any("norm" in n.lower() for n in kept)


def test_runlocal_configs_resolve():
    for module in (base, large, roberta):
        exp = common.resolve(module.get_config("runlocal"), BertSettings, MLMTask)
        assert exp.settings.dataset == "synthetic_topics"
    assert common.resolve(roberta.get_config(), BertSettings, MLMTask).model(50_265).heads == ("mlm",)
    lamb = common.resolve(large.get_config("lamb"), BertSettings, MLMTask)
    assert (lamb.train.optimizer.name, lamb.train.batch_size, lamb.settings.phase2_batch_size,
            lamb.train.num_train_steps, lamb.settings.phase2_start_step) == ("lamb", 65_536, 32_768, 8_599, 7_038)
    with pytest.raises(ValueError, match="unknown config argument"):
        base.get_config("runlokal")


def test_wikipedia_on_mock_data(tmp_path):
    """The wikipedia path on tfds.testing.mock_data: the real builder's features (title, text)
    and only a train split, so the held-out documents are carved from train, disjoint and
    deterministic; the vocabulary lands in <workdir>/vocab.txt and streamed batches come out."""
    config = base.get_config()
    config.dataset, config.eval_documents, config.chunk_documents = "wikipedia", 8, 10
    settings = common.settings_of(config, BertSettings)
    with tfds_mock.mock_data(num_examples=40):
        example = sources.load("wikipedia", "train")[0]
        assert set(example) == {"title", "text"}
        with pytest.raises(ValueError, match="no split 'validation'"):
            sources.load("wikipedia", "validation")
        corpus = pretrain.corpus(settings, str(tmp_path))
        assert len(corpus) == 4
        keys, held_out = documents.hold_out(corpus, 8)
        assert (keys, held_out) == documents.hold_out(corpus, 8)
        everything = [kd for c in range(len(corpus)) for kd in corpus.chunk(c)]
        train = [d for k, d in everything if k not in keys]
        tok = pretrain.tokenizer(dataclasses.replace(settings, vocab_size=200), str(tmp_path), corpus, keys)
        stream = streaming.PretrainingStream(corpus, tok, batch_size=4, max_seq_length=32,
                                             max_predictions_per_seq=5, exclude=keys)
        batch = next(stream)
    assert len(held_out) == 8 and len(train) + len(held_out) == len(everything) == 40
    assert not {tuple(d) for d in held_out} & {tuple(d) for d in train}
    assert os.path.exists(tmp_path / "vocab.txt")
    assert tokenizers.WordPieceTokenizer.load(tmp_path / "vocab.txt").vocab_size == tok.vocab_size
    other = tmp_path / "other"  # an existing vocabulary (e.g. a HF checkpoint dir) is used as is
    loaded = pretrain.tokenizer(dataclasses.replace(settings, vocab_path=str(tmp_path)), str(other), corpus)
    assert loaded.encode("the garden opens") == tok.encode("the garden opens")
    assert (other / "vocab.txt").read_text() == (tmp_path / "vocab.txt").read_text()
    assert batch["input_ids"].shape == (4, 32) and (batch["input_ids"][:, 0] == tok.cls_id).all()


def test_only_process_zero_trains_the_vocabulary(tmp_path, monkeypatch):
    """Process 0 trains and writes vocab.txt; every other process reads that file (hosts with
    vocabularies of their own would train on different ids) and, without it, fails naming the
    shared workdir instead of training."""
    settings = dataclasses.replace(common.settings_of(base.get_config(), BertSettings), vocab_size=150,
                                   vocab_documents=40)
    corpus = documents.Corpus([documents.TextDocuments(
        [synthetic.write_text_corpus(tmp_path / "text", 60_000, seed=1)], chunk_bytes=20_000)])
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(ValueError, match="process 1 finds no .*vocab.txt, which process 0 trained"):
        pretrain.tokenizer(settings, str(tmp_path / "w"), corpus)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    trained = pretrain.tokenizer(settings, str(tmp_path / "w"), corpus)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    read = pretrain.tokenizer(settings, str(tmp_path / "w"), corpus)
    assert read._vocab == trained._vocab and 100 < trained.vocab_size <= 150


def test_bad_settings_are_named(tmp_path):
    c = _tiny_config(tmp_path, num_train_steps=3, phase2_start_step=5)
    with pytest.raises(ValueError, match="phase2_start_step=5"):
        pretrain.train_and_evaluate(c, str(tmp_path / "a"))
    c = _tiny_config(tmp_path, num_train_steps=3, eval_documents=1)
    with pytest.raises(ValueError, match="eval_documents=1"):
        pretrain.train_and_evaluate(c, str(tmp_path / "b"))
    c = _tiny_config(tmp_path, num_train_steps=3, next_sentence=False)
    with pytest.raises(ValueError, match="next_sentence=False needs model heads without 'nsp'"):
        pretrain.train_and_evaluate(c, str(tmp_path / "c"))


def test_mlm_only_task_without_nsp():
    """RoBERTa's batches have no nsp_label: MLMTask scores the MLM term alone, equal to the
    mean negative log-likelihood of the masked tokens computed here in numpy."""
    import flax.linen as nn
    cfg = presets.tiny("encoder", heads=("mlm",), type_vocab_size=1)
    rng = np.random.default_rng(0)
    batch = dict(input_ids=rng.integers(5, 64, (2, 16)).astype(np.int32),
                 token_type_ids=np.zeros((2, 16), np.int32), attention_mask=np.ones((2, 16), np.int32),
                 mlm_positions=np.array([[1, 4, 7], [2, 3, 0]], np.int32),
                 mlm_ids=rng.integers(5, 64, (2, 3)).astype(np.int32),
                 mlm_weights=np.array([[1, 1, 1], [1, 1, 0]], np.int32))
    model, task = EncoderModel(cfg), MLMTask()

    @jax.jit
    def run():
        params = nn.unbox(task.init_variables(model, jax.random.PRNGKey(0), batch)["params"])
        logits = model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                             segment_ids=batch["attention_mask"], mlm_positions=batch["mlm_positions"]).mlm_logits
        totals = task.weight_totals(batch)
        return logits, task.loss(model, params, batch, jax.random.PRNGKey(1), totals, deterministic=True)

    logits, (objective, metrics) = run()
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), batch["mlm_ids"][..., None], axis=-1)[..., 0]
    expected = (nll * batch["mlm_weights"]).sum() / batch["mlm_weights"].sum()
    assert float(objective) == pytest.approx(expected, rel=1e-5)
    assert "nsp_loss" not in metrics and float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)
