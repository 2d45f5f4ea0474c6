"""BERT fine-tuning (experiments.bert.finetune): GLUE and SQuAD v1.1.

References: scikit-learn / SciPy for the GLUE metrics; a separate implementation of the
official SQuAD v1.1 evaluate script's logic (below) for EM/F1; Hugging Face transformers
(PyTorch, fp32) for the span and regression heads on a converted checkpoint (max-abs 1e-4);
brute force over every span for the answer search. End to end on tfds.testing.mock_data:
the reported dev metrics are recomputed from the final checkpoint's params, with a plain
forward pass and the references (1e-4 absolute, in percent).
"""
import dataclasses
import json
import os
import re
import shutil
import string
import subprocess
import sys
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

import tfds_mock  # noqa: E402
from experiments import common  # noqa: E402
from experiments.bert import finetune, finetune_metrics as fm, glue, squad  # noqa: E402
from experiments.bert.configs import glue as glue_config, squad as squad_config  # noqa: E402
from tfm.convert import from_hf  # noqa: E402
from tfm.data import tokenizers  # noqa: E402
from tfm.models import EncoderModel  # noqa: E402
from tfm.train import Checkpointer, TrainState  # noqa: E402
from tfm.train.init_from import merge_params  # noqa: E402
from tfm.train.optim import make_optimizer  # noqa: E402
from tfm.train.config import OptimizerConfig  # noqa: E402

WORDS = ("the a an denver broncos won super bowl fifty in santa clara california game team city "
         "played against carolina panthers on february seventh which river flows through paris "
         "seine france capital is large old new").split()


# ------------------------------------------------------------------------------ metrics

def _cases():
    rng = np.random.default_rng(0)
    for n in (7, 50, 333):
        yield rng.integers(0, 2, n), rng.integers(0, 2, n)
    yield np.ones(10, int), rng.integers(0, 2, 10)  # one predicted class: MCC undefined -> 0
    yield np.zeros(6, int), np.zeros(6, int)        # no positives at all: F1 0


@pytest.mark.parametrize("case", range(5))
def test_classification_metrics_equal_sklearn(case):
    p, y = list(_cases())[case]
    assert fm.accuracy(p, y) == pytest.approx(sklearn.metrics.accuracy_score(y, p), abs=1e-12)
    assert fm.f1(p, y) == pytest.approx(sklearn.metrics.f1_score(y, p, zero_division=0), abs=1e-12)
    assert fm.matthews_corr(p, y) == pytest.approx(sklearn.metrics.matthews_corrcoef(y, p), abs=1e-12)


@pytest.mark.parametrize("ties", [False, True])
def test_correlations_equal_scipy(ties):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=200), rng.normal(size=200)
    y = y + 0.5 * x
    if ties:  # STS-B scores repeat: ranks must average over ties
        x, y = np.round(x), np.round(y * 2) / 2
    assert fm.pearson(x, y) == pytest.approx(scipy.stats.pearsonr(x, y)[0], abs=1e-12)
    assert fm.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0], abs=1e-12)


def test_metrics_refuse_mismatched_inputs():
    with pytest.raises(ValueError, match="equal-length"):
        fm.accuracy([1, 0], [1])


# Independent reimplementation of the official SQuAD v1.1 evaluate-v1.1.py logic.
def _official_normalize(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _official_f1(prediction, ground_truth):
    p, g = _official_normalize(prediction).split(), _official_normalize(ground_truth).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0
    precision, recall = 1.0 * same / len(p), 1.0 * same / len(g)
    return (2 * precision * recall) / (precision + recall)


def _official_evaluate(dataset, predictions):
    f1 = exact_match = total = 0
    for qa in dataset:
        total += 1
        if qa["id"] not in predictions:
            continue
        truths, pred = qa["answers"], predictions[qa["id"]]
        exact_match += max(_official_normalize(pred) == _official_normalize(t) for t in truths)
        f1 += max(_official_f1(pred, t) for t in truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def test_squad_scores_equal_official_logic():
    dataset = [
        {"id": "q1", "answers": ["Denver Broncos", "the Denver Broncos"]},
        {"id": "q2", "answers": ["Santa Clara, California"]},
        {"id": "q3", "answers": ["February 7, 2016", "February 7"]},
        {"id": "q4", "answers": ["an apple"]},
        {"id": "q5", "answers": ["Seine river", "the Seine"]},
        {"id": "q6", "answers": ["x"]},  # no prediction: scores 0
    ]
    predictions = {"q1": "The  Denver Broncos!", "q2": "Santa Clara", "q3": "7 February 2016",
                   "q4": "An   Apple.", "q5": "river seine of France"}
    ours = fm.squad_scores(predictions, {q["id"]: q["answers"] for q in dataset})
    ref = _official_evaluate(dataset, predictions)
    print(f"SQuAD EM/F1 ours {ours} official logic {ref}")
    assert ours["exact_match"] == pytest.approx(ref["exact_match"], abs=1e-9)
    assert ours["f1"] == pytest.approx(ref["f1"], abs=1e-9)
    assert 0 < ref["exact_match"] < ref["f1"] < 100  # the cases separate EM from F1


# ------------------------------------------------------------------------ SQuAD windows

@pytest.fixture(scope="module")
def tok():
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 12)) + ", 2016." for _ in range(200)]
    return tokenizers.train_wordpiece(texts, 120)


def _settings(**kw):
    base = dict(dataset="squad", max_seq_length=32, num_epochs=1.0, warmup_proportion=0.1,
                learning_rates="5e-5", doc_stride=6, max_query_length=5, n_best_size=20,
                max_answer_length=30, max_train_examples=0, max_eval_examples=0)
    return finetune.FinetuneSettings(**{**base, **kw})


def _squad_examples(n, seed):
    """Contexts of 25-40 words with the answer (2-3 words) somewhere inside, at its answer_start."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = list(rng.choice(WORDS, rng.integers(25, 41)))
        at, length = int(rng.integers(0, len(words) - 3)), int(rng.integers(2, 4))
        context = " ".join(words)
        answer = " ".join(words[at:at + length])
        start = len(" ".join(words[:at])) + (1 if at else 0)
        out.append({"id": f"q{seed}_{i}", "title": "t", "context": context,
                    "question": "which " + " ".join(rng.choice(WORDS, 6)),
                    "answers": {"text": np.asarray([answer, answer.upper()]),
                                "answer_start": np.asarray([start, start], np.int32)}})
    return out


def test_squad_training_labels_point_at_the_answer_in_every_window_that_holds_it(tok):
    settings = _settings()
    examples = _squad_examples(12, 0)
    feats, windows, exs = squad.features(examples, tok, settings, train=True)
    assert len(feats) > 2 * len(examples)  # long contexts: several windows each
    found = set()
    for f, w in zip(feats, windows):
        s, e = int(f["start_positions"]), int(f["end_positions"])
        ex = exs[w.example]
        if s == 0:
            assert e == 0
            continue
        offsets = ex["offsets"]
        text = ex["context"][offsets[w.start + s - w.first][0]:offsets[w.start + e - w.first][1]]
        assert text == ex["answers"][0]
        found.add(w.example)
        context_ids = tok.encode_with_offsets(ex["context"])[0]
        assert f["token_type_ids"][s] == 1 and f["input_ids"][s] == context_ids[w.start + s - w.first]
    assert found == set(range(len(examples)))
    assert len(feats[0]["input_ids"]) == settings.max_seq_length


def test_windows_cover_the_context_with_the_stride_and_pick_max_context():
    spans = squad.window_spans(20, 8, 3)
    assert spans == [(0, 8), (3, 8), (6, 8), (9, 8), (12, 8)]
    covered = {t for s, n in spans for t in range(s, s + n)}
    assert covered == set(range(20))
    # every token has its maximal context in exactly one window
    owners = np.zeros(20, int)
    for k, (s, n) in enumerate(spans):
        owners[s:s + n] += squad.max_context(spans, k)
    assert (owners == 1).all()
    assert squad.max_context(spans, 1)[4]  # token 7: 4 left, 3 right in window 1 beats window 0's (0 right)


def _brute_force_answer(s_logits, e_logits, w, max_len):
    best, span = -np.inf, None
    for s in range(len(s_logits)):
        for e in range(len(e_logits)):
            i, j = s - w.first, e - w.first
            if 0 <= i <= j < w.length and j - i + 1 <= max_len and w.max_context[i]:
                if s_logits[s] + e_logits[e] > best:
                    best, span = s_logits[s] + e_logits[e], (i, j)
    return best, span


def test_best_answers_equal_brute_force_over_every_span(tok):
    settings = _settings(max_seq_length=24, doc_stride=5)
    feats, windows, exs = squad.features(_squad_examples(6, 1), tok, settings, train=False)
    rng = np.random.default_rng(3)
    T = settings.max_seq_length
    s_logits, e_logits = rng.normal(size=(len(feats), T)), rng.normal(size=(len(feats), T))
    got = squad.best_answers(s_logits, e_logits, windows, exs, n_best_size=T, max_answer_length=4)
    for k, ex in enumerate(exs):
        cands = [(_brute_force_answer(s_logits[f], e_logits[f], w, 4), w) for f, w in enumerate(windows)
                 if w.example == k]
        (score, (i, j)), w = max(cands, key=lambda c: c[0][0])
        want = ex["context"][ex["offsets"][w.start + i][0]:ex["offsets"][w.start + j][1]]
        assert got[ex["id"]] == want
    # n_best_size limits the candidates: with 1, only the top start and end of each window count
    top1 = squad.best_answers(s_logits, e_logits, windows, exs, n_best_size=1, max_answer_length=4)
    assert top1 != got


# ----------------------------------------------------------------- checkpoints to start from

HF = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
          max_position_embeddings=64, type_vocab_size=2, attn_implementation="eager")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tok):
    """BertForPreTraining(small config).save_pretrained(dir) + vocab.txt, written offline."""
    path = tmp_path_factory.mktemp("hf_bert")
    torch.manual_seed(0)
    model = tr.BertForPreTraining(tr.BertConfig(vocab_size=tok.vocab_size, **HF)).eval()
    model.save_pretrained(path)
    tok.save(os.path.join(path, "vocab.txt"))
    return str(path), model


@pytest.fixture(scope="module")
def tfm_workdir(tmp_path_factory, hf_dir):
    """A tfm pretraining workdir: config.json (model_config), checkpoints/<step>/ with a full
    TrainState (params, Adam state), vocab.txt. Its params are the HF model's, shifted."""
    path = str(tmp_path_factory.mktemp("tfm_bert"))
    cfg, params, _ = from_hf(hf_dir[0])
    params = jax.tree.map(lambda x: np.asarray(x) + 0.01, params)
    tx, _ = make_optimizer(OptimizerConfig(), 10)
    state = TrainState(step=np.int32(7), params=params, opt_state=jax.tree.map(np.asarray, tx.init(params)),
                       rng=np.zeros(2, np.uint32))
    ckpt = Checkpointer(os.path.join(path, "checkpoints"), every=1, async_save=False)
    ckpt.save(7, state, force=True)
    ckpt.close()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_config": dataclasses.asdict(cfg)}, f)
    shutil.copy(os.path.join(hf_dir[0], "vocab.txt"), os.path.join(path, "vocab.txt"))
    return path, params


def test_tfm_workdir_loads_encoder_and_pooler_and_drops_pretraining_heads(tfm_workdir):
    path, params = tfm_workdir
    pre = finetune.load_pretrained(path)
    assert sorted(pre.params) == ["embed", "encoder", "input", "pooler"]
    for a, b in zip(jax.tree.leaves(pre.params), jax.tree.leaves({k: params[k] for k in pre.params})):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert pre.config.heads == () and "checkpoints/7" in pre.source


def test_span_and_regression_heads_on_an_hf_checkpoint_equal_transformers(hf_dir):
    """Init from the HF directory (encoder and pooler kept), heads set from HF's own
    BertForQuestionAnswering / BertForSequenceClassification(num_labels=1) on the same encoder."""
    path, pretraining = hf_dir
    pre = finetune.load_pretrained(path)
    cfg = pre.config.replace(heads=("regression", "span"))
    model = EncoderModel(cfg)
    ids = np.random.default_rng(0).integers(5, pre.config.vocab_size, (2, 10))
    types, mask = (np.arange(10) >= 6).astype(int)[None].repeat(2, 0), (np.arange(10)[None] < [[10], [7]]).astype(int)
    fresh = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0), jnp.asarray(ids))["params"]))
    torch.manual_seed(1)
    qa = tr.BertForQuestionAnswering(tr.BertConfig(vocab_size=pre.config.vocab_size, **HF)).eval()
    reg = tr.BertForSequenceClassification(tr.BertConfig(vocab_size=pre.config.vocab_size, num_labels=1, **HF)).eval()
    qa.bert.load_state_dict(pretraining.bert.state_dict(), strict=False)
    reg.bert.load_state_dict(pretraining.bert.state_dict())
    heads = {"span": {"kernel": qa.qa_outputs.weight.detach().numpy().T, "bias": qa.qa_outputs.bias.detach().numpy()},
             "regressor": {"kernel": reg.classifier.weight.detach().numpy().T,
                           "bias": reg.classifier.bias.detach().numpy()}}
    params = merge_params(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), fresh), pre.params, source=pre.source,
                          optional=finetune.OPTIONAL_PARAMS)
    assert {"pooler", "encoder"} <= set(pre.params) and not set(heads) & set(pre.params)
    params = {**params, **heads}
    out = jax.jit(model.apply)({"params": params}, jnp.asarray(ids), token_type_ids=jnp.asarray(types),
                               segment_ids=jnp.asarray(mask))
    t = lambda x: torch.tensor(x)
    with torch.no_grad():
        q = qa(t(ids), attention_mask=t(mask), token_type_ids=t(types))
        r = reg(t(ids), attention_mask=t(mask), token_type_ids=t(types))
    diffs = [np.abs(np.asarray(out.start_logits) - q.start_logits.numpy())[mask == 1].max(),
             np.abs(np.asarray(out.end_logits) - q.end_logits.numpy())[mask == 1].max(),
             np.abs(np.asarray(out.score) - r.logits.numpy()[:, 0]).max()]
    print(f"span start/end, regression max-abs vs transformers: {diffs}")
    assert max(diffs) < 1e-4


# ----------------------------------------------------------------------------- end to end

def _tiny_run(config, **kw):
    """2 steps of batch 8 on 16 examples, 12 dev examples (the last eval batch padded)."""
    config.update({**dict(max_seq_length=32, max_train_examples=16, max_eval_examples=12, batch_size=8,
                          progress_bar=False, log_every=1, checkpoint_every=0), **kw})
    return config


def _forward(params, init, heads, feats, keys, num_labels=2):
    """The model's outputs on `feats` with `params`, one plain batch (no padding, no sharding)."""
    pre = finetune.load_pretrained(init)
    model = EncoderModel(pre.config.replace(heads=heads, num_labels=num_labels))
    batch = {k: jnp.asarray(np.stack([f[k] for f in feats])) for k in ("input_ids", "token_type_ids", "attention_mask")}
    out = jax.jit(model.apply)({"params": params}, batch["input_ids"], token_type_ids=batch["token_type_ids"],
                               segment_ids=batch["attention_mask"])
    return {k: np.asarray(getattr(out, k)) for k in keys}


REFERENCE = {"matthews_corr": lambda p, y: sklearn.metrics.matthews_corrcoef(y, p),
             "accuracy": lambda p, y: sklearn.metrics.accuracy_score(y, p),
             "f1": lambda p, y: sklearn.metrics.f1_score(y, p, zero_division=0),
             "pearson": lambda p, y: scipy.stats.pearsonr(p, y)[0],
             "spearman": lambda p, y: scipy.stats.spearmanr(p, y)[0]}


def _check_dev_metrics(task, dev, params, init, data):
    """The dev metrics of `params`' predictions (a plain forward pass) equal the references;
    the run's reported ones equal them up to the float32 rounding of a sharded forward (identical
    classes; STS-B's near-constant untrained scores turn it into up to 0.01 correlation points)."""
    spec = glue.TASKS[task]
    key = "score" if spec.regression else "logits"
    heads = ("regression",) if spec.regression else ("classification",)
    outputs = {}

    def predict(feats, keys):
        outputs[len(outputs)] = _forward(params, init, heads, feats, keys, max(spec.num_labels, 2))
        return outputs[len(outputs) - 1]

    recomputed = data.evaluate(predict)
    for (prefix, feats), out in zip(data.dev, outputs.values()):
        pred = out[key].astype(np.float64) if spec.regression else out[key].argmax(-1)
        labels = np.asarray([f["label"] for f in feats])
        for m in spec.metrics:
            name = f"{task}_{prefix + '_' if prefix else ''}{m}"
            assert recomputed[name] == pytest.approx(100 * REFERENCE[m](pred, labels), abs=1e-9), name
            assert dev[name] == pytest.approx(recomputed[name], abs=1e-2 if spec.regression else 1e-9), name
    names = [f"{task}_{p + '_' if p else ''}{m}" for p, _ in spec.eval_splits for m in spec.metrics]
    assert sorted(dev) == sorted(names + [f"{task}_score"])
    assert dev[f"{task}_score"] == pytest.approx(np.mean([dev[n] for n in names]), abs=1e-9)


def _glue_data(task, config, init):
    return glue.Glue(f"glue/{task}", common.settings_of(config, finetune.FinetuneSettings),
                     finetune.load_pretrained(init).tokenizer)


@pytest.mark.parametrize("task", ["mrpc", "stsb"])
def test_glue_end_to_end_from_hf_checkpoint(task, hf_dir, tmp_path):
    """F1 and accuracy, Pearson and Spearman (Matthews: the sweep below): train 2 steps,
    evaluate; the reported metrics equal the references on the final params."""
    path, _ = hf_dir
    config = _tiny_run(finetune.runlocal(glue_config.get_config(task)))
    with tfds_mock.mock_data(num_examples=20):
        result = finetune.train_and_evaluate(config, str(tmp_path), path)
        data = _glue_data(task, config, path)
    print(f"{task}: {result['dev']}")
    assert result["steps"] == 2 and not result["preempted"]
    _check_dev_metrics(task, result["dev"], result["params"], path, data)


def test_mnli_reports_matched_and_mismatched_dev_accuracy(tok):
    """Each dev split scored on its own predictions (fixed logits, no model)."""
    settings = common.settings_of(finetune.runlocal(glue_config.get_config("mnli")), finetune.FinetuneSettings)
    with tfds_mock.mock_data(num_examples=30):
        data = glue.Glue("glue/mnli", dataclasses.replace(settings, max_eval_examples=0, max_seq_length=16), tok)
    rng = np.random.default_rng(0)
    logits = {}

    def predict(feats, keys):
        logits[len(logits)] = rng.normal(size=(len(feats), 3))
        return {"logits": logits[len(logits) - 1]}

    dev = data.evaluate(predict)
    want = {f"mnli_{p}_accuracy": 100 * sklearn.metrics.accuracy_score([f["label"] for f in feats],
                                                                         logits[i].argmax(-1))
            for i, (p, feats) in enumerate(data.dev)}
    print(f"mnli: {dev}")
    assert [p for p, _ in data.dev] == ["m", "mm"] and len(set(want.values())) == 2
    assert dev == pytest.approx({**want, "mnli_score": np.mean(list(want.values()))}, abs=1e-9)


def test_glue_sweep_from_tfm_workdir_keeps_the_best_run(tfm_workdir, tmp_path):
    """CoLA (Matthews correlation) at two learning rates from a tfm pretraining workdir."""
    path, _ = tfm_workdir
    config = _tiny_run(finetune.runlocal(glue_config.get_config("cola")), learning_rates="1e-2,1e-4")
    with tfds_mock.mock_data(num_examples=20):
        summary = finetune.sweep(config, str(tmp_path), path)
        data = _glue_data("cola", config, path)
    with open(tmp_path / "sweep.json") as f:
        written = json.load(f)
    print(f"cola sweep: {[(r['learning_rate'], r['dev']) for r in written['runs']]}")
    assert [r["learning_rate"] for r in written["runs"]] == [1e-2, 1e-4]
    scores = [r["dev"]["cola_score"] for r in written["runs"]]
    assert written["best"]["dev"]["cola_score"] == max(scores) == summary["best"]["dev"]["cola_score"]
    assert (tmp_path / "lr_0.01" / "metrics.jsonl").exists() and (tmp_path / "lr_0.0001" / "metrics.jsonl").exists()
    _check_dev_metrics("cola", summary["best"]["dev"], summary["best_params"], path, data)


def test_squad_end_to_end_from_hf_checkpoint(hf_dir, tmp_path):
    path, _ = hf_dir
    train, dev = _squad_examples(16, 5), _squad_examples(5, 6)

    def as_data_source(self, split, **kwargs):
        return {"train": train, "validation": dev}[split]

    config = _tiny_run(squad_config.get_config("runlocal"), max_seq_length=48, doc_stride=16,
                       max_query_length=8, max_train_examples=0, max_eval_examples=0)
    with tfds_mock.mock_data(as_data_source_fn=as_data_source):
        result = finetune.train_and_evaluate(config, str(tmp_path), path)
        data = squad.Squad("squad", common.settings_of(config, finetune.FinetuneSettings),
                           finetune.load_pretrained(path).tokenizer)
    print(f"squad: {result['dev']} over {len(data.dev)} windows of {len(dev)} questions")
    assert len(data.dev) > len(dev)  # several windows per question
    out = _forward(result["params"], path, ("span",), data.dev, ("start_logits", "end_logits"))
    answers = squad.best_answers(out["start_logits"], out["end_logits"], data.windows, data.examples, 20, 30)
    ref = _official_evaluate([{"id": e["id"], "answers": e["answers"]} for e in data.examples], answers)
    assert result["dev"]["squad_exact_match"] == pytest.approx(ref["exact_match"], abs=1e-4)
    assert result["dev"]["squad_f1"] == pytest.approx(ref["f1"], abs=1e-4)
    assert any(answers.values())  # spans were found, not only empty answers


# --------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("task", sorted(glue.TASKS))
def test_every_glue_config_reads_its_real_features_and_splits(task, tok):
    settings = common.settings_of(finetune.runlocal(glue_config.get_config(task)), finetune.FinetuneSettings)
    with tfds_mock.mock_data(num_examples=3):
        data = glue.Glue(settings.dataset, dataclasses.replace(settings, max_seq_length=16), tok)
    assert len(data.train) == 3 and [p for p, _ in data.dev] == [p for p, _ in glue.TASKS[task].eval_splits]
    f = data.train[0]
    pair = len(glue.TASKS[task].text_keys) == 2
    assert f["input_ids"][0] == tok.cls_id and (f["token_type_ids"].max() == 1) == pair


def test_clear_errors(tfm_workdir, hf_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown GLUE task 'glue/wnli'.*glue/rte"):
        glue.task_of("glue/wnli")
    with pytest.raises(ValueError, match="unknown GLUE task"):
        glue_config.get_config("mnli_m")
    no_vocab = tmp_path / "no_vocab"
    no_vocab.mkdir()
    (no_vocab / "config.json").write_text(open(os.path.join(hf_dir[0], "config.json")).read())
    with pytest.raises(ValueError, match="has no vocab.txt"):
        finetune.load_pretrained(str(no_vocab))
    with pytest.raises(ValueError, match="has no config.json"):
        finetune.load_pretrained(str(tmp_path))
    config = _tiny_run(finetune.runlocal(glue_config.get_config("rte")), max_seq_length=65)
    too_long = "max_seq_length=65 exceeds .* max_len=64"
    with tfds_mock.mock_data(num_examples=8), pytest.raises(ValueError, match=too_long):
        finetune.train_and_evaluate(config, str(tmp_path / "run"), tfm_workdir[0])
    config = _tiny_run(finetune.runlocal(glue_config.get_config("rte")))
    config.optimizer.warmup_steps = 3
    with tfds_mock.mock_data(num_examples=8), pytest.raises(ValueError, match="warmup_proportion or"):
        finetune.train_and_evaluate(config, str(tmp_path / "run"), tfm_workdir[0])
    config = _tiny_run(finetune.runlocal(glue_config.get_config("rte")))
    config.model.preset = "bert_base"
    with tfds_mock.mock_data(num_examples=8), pytest.raises(ValueError, match="model from a checkpoint"):
        finetune.train_and_evaluate(config, str(tmp_path / "run"), tfm_workdir[0])
    with pytest.raises(ValueError, match="learning_rates"):
        finetune.learning_rates(_settings(learning_rates="2e-5;3e-5"))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_says_in_one_line_that_glue_is_not_prepared_and_how(hf_dir, tmp_path):
    """The real glue.py:rte recipe on an empty data_dir and on an interrupted preparation (a
    dataset_info.json without splits, TFDS's KeyError): exit 1, one line on stderr (beside absl
    logs) naming the dataset, the directory and the command that prepares it."""
    from test_data_pipeline import UNPREPARED
    for form in ("empty", "no_splits"):
        data_dir = tmp_path / form
        UNPREPARED[form][0](data_dir)
        run = subprocess.run([sys.executable, "-m", "experiments.bert.finetune", "--config=experiments/bert/configs/glue.py:rte",
                              f"--init={hf_dir[0]}", f"--workdir={tmp_path / 'run'}", f"--config.data_dir={data_dir}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith(("W", "I"))]
        want = (f"error: dataset glue/rte split 'train' is not prepared as array_record under {data_dir}; prepare it "
                f"with `tfds build glue/rte --file_format=array_record --data_dir={data_dir}` (needs the tf extra)")
        assert run.returncode == 1 and lines == [want], (form, run.returncode, run.stderr[-3000:])
