"""Tasks: how a batch feeds a model and which losses it yields, one class per family.

Batches are dicts of fixed-shape arrays with the batch on dim 0:
  LMTask (DecoderLM)          inputs, targets [B, T]; optional weights, segment_ids, positions.
  MLMTask (EncoderModel)      input_ids, token_type_ids, attention_mask [B, T] (1 = token);
                              mlm_positions, mlm_ids, mlm_weights [B, P]; nsp_label [B]
                              (the keys of `tfm.data.pretraining`; without nsp_label, MLM only).
  Seq2SeqTask (EncoderDecoder) inputs [B, S]; targets_in, targets [B, T]; optional weights,
                              {inputs,targets}_{segment_ids,positions}.
  ClassificationTask,         input_ids, token_type_ids, attention_mask [B, T]; optional
  RegressionTask,             weights [B] (0 = a padding row); label [B] (int class /
  SpanTask (EncoderModel)     float score), or start_positions, end_positions [B] (span).
  LMClassificationTask        inputs, targets [B, T] or [B, choices, T]; label [B]; optional
  (DecoderLM + head, GPT-1)   weights, cls_positions: task loss + lm_weight * LM loss.
  ImageClassificationTask     images [B, H, W, C]; label [B]; optional weights [B].
  (VisionEncoder, ViT)
  ImageTextTask               LMTask's entries (inputs may hold the image tokens past V) and
  (VisionLanguageModel)       images [B, I, X, H, W, C], aspect_ratio_ids [B, I], aspect_ratio_mask
                              [B, I, X]; optional cross_attention_mask [B, T, I, X].
  ContrastiveTask             query_ids, query_mask, doc_ids, doc_mask [B, T]: InfoNCE over
  (EncoderModel + mean_pool)  in-batch negatives (E5-style sentence embeddings).

Models hand a task their typed output (`tfm.models.outputs`); `loss_terms` turns it into one
`LossTerm` (ce, z, weight, correct) per named term. `loss` returns the objective of one
(micro)batch with every sum already divided by the full batch's totals, so summing
microbatch results gives exactly the full-batch value.

With `vocab_chunk` set, the LM, MLM and seq2seq tasks ask the model for its `Unembedding` and
score it with `fused_cross_entropy` (chunks of at most vocab_chunk vocabulary columns), so
the fp32 logits [B, T, V] and their gradient are never held whole; None keeps the plain
logits path.

Ids: `id_fields` lists each task's integer entries and their ranges; the trainer checks the
host batch against them (`tfm.train.batch_checks`) and names the first offending value.
Inside the step an out-of-range target is never scored as a wrapped id: where its weight is
nonzero the loss becomes NaN, where it is zero (padding) it is ignored.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from tfm.train.config import refuse_unread
from tfm.train.losses import LossTerm, cross_entropy, fused_cross_entropy


class IdField(NamedTuple):
    """A batch entry of integer ids that must lie in [0, bound): everywhere, or only where the
    batch entry `weights` is nonzero (padding there may hold any value)."""
    key: str
    bound: int
    weights: Optional[str] = None


def learned_position_fields(config, *keys: str) -> list[IdField]:
    """Explicit positions entries index a learned table [max_len, D] (from row position_offset)
    at every token, padding included; other position kinds have no table to leave."""
    if config.position != "learned":
        return []
    return [IdField(key, config.max_len - config.position_offset) for key in keys]


INDEXER_LOSS = "indexer_kl_loss"  # the name DeepSeek Sparse Attention's indexer sows its loss under


@dataclasses.dataclass(frozen=True)
class Task:
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    moe_aux_weight: float = 1.0  # multiplies the sown loss (the model applies its router coefficient)
    # DeepSeek Sparse Attention: the indexer's KL loss (`losses/indexer_kl_loss`) times this in the objective; the
    # loss is a metric whenever the model has an indexer, and only this trains the indexer (its input is detached)
    indexer_loss_weight: float = 0.0
    vocab_chunk: Optional[int] = None  # fused chunked cross-entropy over the vocabulary; None = plain logits
    reads = ("label_smoothing", "z_loss", "vocab_chunk")  # the loss fields this task's loss uses

    def __post_init__(self):
        if self.vocab_chunk is not None and self.vocab_chunk < 1:
            raise ValueError(f"Task.vocab_chunk must be >= 1 or None, got {self.vocab_chunk}")
        reads = ", ".join(self.reads) if self.reads else "none of " + ", ".join(Task.reads)
        refuse_unread(self, Task.reads, self.reads, f"by its loss (which reads {reads})")

    # --- per family -------------------------------------------------------------------
    def model_kwargs(self, batch: dict) -> dict:
        raise NotImplementedError

    def loss_terms(self, outputs, batch: dict) -> dict[str, LossTerm]:
        """term name -> its `LossTerm` (the names key `weights` and the per-term metrics);
        the first term's `correct` gives "accuracy"."""
        raise NotImplementedError

    def num_tokens(self, batch: dict) -> int:
        """Tokens the model processes per batch (for tokens/s)."""
        raise NotImplementedError

    def id_fields(self, config, batch: dict) -> list[IdField]:
        """The batch's id entries and their ranges under ModelConfig `config`."""
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------
    def init_variables(self, model, rng, batch: dict):
        return model.init({"params": rng, "dropout": rng}, **self.model_kwargs(batch),
                          deterministic=True)

    def forward(self, model, params, batch, rng, deterministic: bool):
        """(model outputs, {name: the sum over layers of the auxiliary loss the model sowed under that name}: the
        routers' (MoE) and the sparse-attention indexer's; empty when it sows none)."""
        outputs, extra = model.apply({"params": params}, **self.model_kwargs(batch),
                                     deterministic=deterministic, rngs={"dropout": rng},
                                     mutable=["losses"])
        sown = {}
        for path, x in jax.tree_util.tree_leaves_with_path(extra.get("losses", {})):
            name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
            sown[name] = sown.get(name, jnp.zeros((), jnp.float32)) + jnp.sum(x)
        return outputs, sown

    def loss(self, model, params, batch, rng, totals: dict, num_micro: int = 1,
             deterministic: bool = False):
        """(objective, metrics) for a (micro)batch; totals from `weight_totals(full batch)`.
        metrics has z_loss only with a z-loss, moe_aux_loss only for a model that sows one (the routers' terms
        summed), indexer_kl_loss only for a model with a sparse-attention indexer."""
        outputs, sown = self.forward(model, params, batch, rng, deterministic)
        terms = self.loss_terms(outputs, batch)
        objective, metrics = 0.0, {"loss": 0.0}
        index_loss = sown.pop(INDEXER_LOSS, None)
        if sown:
            aux = sum(sown.values())
            objective, metrics["moe_aux_loss"] = self.moe_aux_weight * aux / num_micro, aux / num_micro
        if index_loss is not None:
            metrics[INDEXER_LOSS] = index_loss / num_micro
            if self.indexer_loss_weight:
                objective += self.indexer_loss_weight * index_loss / num_micro
        if self.z_loss:
            metrics["z_loss"] = 0.0
        for i, (name, t) in enumerate(terms.items()):
            norm, scale = totals[name], self.term_weight(name)
            objective += scale * (t.ce + t.z) / norm
            metrics["loss"] += scale * t.ce / norm
            if self.z_loss:
                metrics["z_loss"] += scale * t.z / norm
            if i == 0 and t.correct is not None:
                metrics["accuracy"] = t.correct / norm
            if len(terms) > 1:
                metrics[f"{name}_loss"] = t.ce / norm
                if t.correct is not None:
                    metrics[f"{name}_accuracy"] = t.correct / norm
        return objective, metrics

    def term_weight(self, name: str) -> float:
        """What loss term `name` is multiplied by in the objective (and in "loss"); its own
        "<name>_loss" metric stays unweighted."""
        return 1.0

    def weight_totals(self, batch: dict) -> dict:
        return {name: jnp.maximum(jnp.sum(w.astype(jnp.float32)), 1.0)
                for name, w in self.weights(batch).items()}

    def weights(self, batch: dict) -> dict:
        raise NotImplementedError

    def _ce(self, logits, unembedding, targets, weights) -> LossTerm:
        """Token cross-entropy of logits [B, T, V], or, when vocab_chunk is set, of the model's
        `Unembedding` (the model was asked for it by `_logits_kwarg`)."""
        kw = dict(label_smoothing=self.label_smoothing, z_loss=self.z_loss)
        if self.vocab_chunk is None:
            return cross_entropy(logits, *_scored(targets, weights, logits.shape[-1]), **kw)
        head = unembedding
        targets, weights = _scored(targets, weights, head.kernel.shape[0])
        return fused_cross_entropy(head.hidden, head.kernel, targets, weights, bias=head.bias,
                                   dtype=head.dtype, vocab_chunk=self.vocab_chunk, **kw)

    def _logits_kwarg(self) -> dict:
        """Asks the model for its `Unembedding` instead of logits when the loss is fused."""
        return {} if self.vocab_chunk is None else {"logits": False}


def _scored(targets, weights, vocab: int):
    """(targets, float weights) with out-of-range targets replaced by 0, and NaN weights where
    such a target was weighted: the loss turns non-finite instead of scoring another id."""
    valid = (targets >= 0) & (targets < vocab)
    weights = weights.astype(jnp.float32)
    return jnp.where(valid, targets, 0), jnp.where(valid | (weights == 0), weights, jnp.nan)


def _weights_or_ones(batch, key, like):
    return batch[key] if key in batch else jnp.ones(batch[like].shape, jnp.float32)


class _LabelLoss:
    """Cross-entropy of a classifier's logits [B, num_labels] (the model output's `logits`)
    against label [B], rows weighted by the optional "weights" [B]: the one loss of sentence
    (pair) and image classification. Mixed in before a `Task`."""
    term = "label"
    reads = ("label_smoothing", "z_loss")

    def weights(self, batch):
        return {self.term: _weights_or_ones(batch, "weights", "label")}

    def loss_terms(self, out, batch):
        w = self.weights(batch)[self.term]
        return {self.term: cross_entropy(out.logits, *_scored(batch["label"], w, out.logits.shape[-1]),
                                         label_smoothing=self.label_smoothing, z_loss=self.z_loss)}


class LMTask(Task):
    def model_kwargs(self, batch):
        return {"tokens": batch["inputs"], "segment_ids": batch.get("segment_ids"),
                "positions": batch.get("positions"), **self._logits_kwarg()}

    def weights(self, batch):
        return {"lm": _weights_or_ones(batch, "weights", "targets")}

    def loss_terms(self, out, batch):
        return {"lm": self._ce(out.logits, out.unembedding, batch["targets"], self.weights(batch)["lm"])}

    def num_tokens(self, batch):
        return int(batch["inputs"].size)

    def id_fields(self, config, batch):
        V = config.vocab_size
        return [IdField("inputs", V), IdField("targets", V, "weights"),
                *learned_position_fields(config, "positions")]


class ImageTextTask(LMTask):
    """Next-token loss of text conditioned on images (`tfm.models.vision_language.VisionLanguageModel`,
    Llama 3.2 Vision): LMTask's batch plus the images and their tile layout."""

    def model_kwargs(self, batch):
        return {**super().model_kwargs(batch), "images": batch["images"], "aspect_ratio_ids": batch["aspect_ratio_ids"],
                "aspect_ratio_mask": batch["aspect_ratio_mask"],
                "cross_attention_mask": batch.get("cross_attention_mask")}

    def id_fields(self, config, batch):
        layouts = config.multimodal.vision.multimodal.max_aspect_ratio_id + 1
        return [IdField("inputs", config.vocab_size + config.multimodal.extra_tokens),
                IdField("targets", config.vocab_size, "weights"), IdField("aspect_ratio_ids", layouts),
                *learned_position_fields(config, "positions")]


class MLMTask(Task):
    def model_kwargs(self, batch):
        mask = batch.get("attention_mask")
        return {"tokens": batch["input_ids"], "token_type_ids": batch.get("token_type_ids"),
                "segment_ids": None if mask is None else mask.astype(jnp.int32),
                "mlm_positions": batch["mlm_positions"], **self._logits_kwarg()}

    def weights(self, batch):
        w = {"mlm": _weights_or_ones(batch, "mlm_weights", "mlm_ids")}
        if "nsp_label" in batch:  # absent for MLM-only pretraining (RoBERTa)
            w["nsp"] = jnp.ones(batch["nsp_label"].shape, jnp.float32)
        return w

    def loss_terms(self, out, batch):
        w = self.weights(batch)
        terms = {"mlm": self._ce(out.mlm_logits, out.mlm_unembedding, batch["mlm_ids"], w["mlm"])}
        if "nsp" in w:
            terms["nsp"] = cross_entropy(out.nsp_logits, *_scored(batch["nsp_label"], w["nsp"], 2))
        return terms

    def num_tokens(self, batch):
        return int(batch["input_ids"].size)

    def id_fields(self, config, batch):
        V = config.vocab_size
        fields = [IdField("input_ids", V), IdField("mlm_positions", batch["input_ids"].shape[1]),
                  IdField("mlm_ids", V, "mlm_weights")]
        if "nsp_label" in batch:
            fields.append(IdField("nsp_label", 2))
        if config.type_vocab_size:
            fields.append(IdField("token_type_ids", config.type_vocab_size))
        return fields


class Seq2SeqTask(Task):
    def model_kwargs(self, batch):
        kw = {"inputs": batch["inputs"], "targets_in": batch["targets_in"]}
        for side in ("inputs", "targets"):
            for what in ("segment_ids", "positions"):
                kw[f"{side}_{what}"] = batch.get(f"{side}_{what}")
        return dict(kw, **self._logits_kwarg())

    def weights(self, batch):
        return {"lm": _weights_or_ones(batch, "weights", "targets")}

    def loss_terms(self, out, batch):
        return {"lm": self._ce(out.logits, out.unembedding, batch["targets"], self.weights(batch)["lm"])}

    def num_tokens(self, batch):
        return int(batch["inputs"].size + batch["targets"].size)

    def id_fields(self, config, batch):
        V = config.vocab_size
        return [IdField("inputs", V), IdField("targets_in", V), IdField("targets", V, "weights"),
                *learned_position_fields(config, "inputs_positions", "targets_positions")]


class _FineTuneTask(Task):
    """Encoder fine-tuning: one example a row, a "weights" [B] entry marking real rows."""

    def model_kwargs(self, batch):
        mask = batch.get("attention_mask")
        return {"tokens": batch["input_ids"], "token_type_ids": batch.get("token_type_ids"),
                "segment_ids": None if mask is None else mask.astype(jnp.int32)}

    def weights(self, batch):
        rows = batch["input_ids"].shape[:1]
        return {self.term: batch["weights"] if "weights" in batch else jnp.ones(rows, jnp.float32)}

    def num_tokens(self, batch):
        return int(batch["input_ids"].size)

    def id_fields(self, config, batch):
        fields = [IdField("input_ids", config.vocab_size)]
        if config.type_vocab_size:
            fields.append(IdField("token_type_ids", config.type_vocab_size))
        return fields


class ClassificationTask(_LabelLoss, _FineTuneTask):
    """Sentence (pair) classification from the pooled [CLS] state: GLUE."""

    def id_fields(self, config, batch):
        return super().id_fields(config, batch) + [IdField("label", config.num_labels, "weights")]


class RegressionTask(_FineTuneTask):
    """A real-valued score from the pooled [CLS] state, squared-error loss: GLUE STS-B."""
    term = "score"
    reads = ()

    def loss_terms(self, out, batch):
        w = self.weights(batch)[self.term].astype(jnp.float32)
        err = out.score - batch["label"].astype(jnp.float32)
        return {self.term: LossTerm(ce=jnp.sum(w * err ** 2), z=jnp.zeros((), jnp.float32), weight=jnp.sum(w))}


class SpanTask(_FineTuneTask):
    """Answer start and end positions over the sequence (SQuAD): the mean of the two
    cross-entropies, as Devlin et al.; "accuracy" counts rows with both ends right."""
    term = "span"
    reads = ("label_smoothing", "z_loss")

    def loss_terms(self, out, batch):
        w = self.weights(batch)[self.term]
        T = out.start_logits.shape[-1]
        kw = dict(label_smoothing=self.label_smoothing, z_loss=self.z_loss)
        start = cross_entropy(out.start_logits, *_scored(batch["start_positions"], w, T), **kw)
        end = cross_entropy(out.end_logits, *_scored(batch["end_positions"], w, T), **kw)
        hit = ((jnp.argmax(out.start_logits, -1) == batch["start_positions"])
               & (jnp.argmax(out.end_logits, -1) == batch["end_positions"]))
        return {self.term: LossTerm(ce=(start.ce + end.ce) / 2, z=(start.z + end.z) / 2,
                                    correct=jnp.sum(hit * w.astype(jnp.float32)), weight=start.weight)}

    def id_fields(self, config, batch):
        T = batch["input_ids"].shape[1]
        return super().id_fields(config, batch) + [IdField("start_positions", T, "weights"),
                                                   IdField("end_positions", T, "weights")]


@dataclasses.dataclass(frozen=True)
class LMClassificationTask(Task):
    """GPT-1 fine-tuning (Radford et al. 2018, eq. 5): task loss + lm_weight * LM loss on the same
    text, for a DecoderLM with the "classification" head.

    Batch: inputs, targets [B, T], or [B, C, T] for multiple choice (C candidates, each scored by
    a head with num_labels=1, softmax over the C scores); optional weights (LM targets, same shape),
    cls_positions [B] / [B, C] (the token the head reads; default T - 1); label [B] (the class, or
    the correct choice).
    """

    lm_weight: float = 0.5  # the paper's lambda

    def __post_init__(self):
        super().__post_init__()
        if self.lm_weight < 0:
            raise ValueError(f"LMClassificationTask.lm_weight must be >= 0, got {self.lm_weight}")

    def model_kwargs(self, batch):
        T = batch["inputs"].shape[-1]
        flat = lambda x: None if x is None else x.reshape(-1, *x.shape[batch["inputs"].ndim - 1:])
        return {"tokens": batch["inputs"].reshape(-1, T), "segment_ids": flat(batch.get("segment_ids")),
                "cls_positions": flat(batch.get("cls_positions")), **self._logits_kwarg()}

    def weights(self, batch):
        lm = _weights_or_ones(batch, "weights", "targets")
        return {"task": jnp.ones(batch["label"].shape, jnp.float32), "lm": lm.reshape(-1, lm.shape[-1])}

    def term_weight(self, name):
        return self.lm_weight if name == "lm" else 1.0

    def loss_terms(self, out, batch):
        w = self.weights(batch)
        scores = out.cls_logits  # [B * C, 1] for multiple choice, else [B, num_labels]
        if batch["inputs"].ndim == 3:
            scores = scores.reshape(batch["inputs"].shape[:2])  # [B, C]
        targets = batch["targets"].reshape(-1, batch["targets"].shape[-1])
        return {"task": cross_entropy(scores, *_scored(batch["label"], w["task"], scores.shape[-1])),
                "lm": self._ce(out.logits, out.unembedding, targets, w["lm"])}

    def num_tokens(self, batch):
        return int(batch["inputs"].size)

    def id_fields(self, config, batch):
        V, shape = config.vocab_size, batch["inputs"].shape
        fields = [IdField("inputs", V), IdField("targets", V, "weights"),
                  IdField("label", shape[1] if len(shape) == 3 else config.num_labels)]
        if "cls_positions" in batch:
            fields.append(IdField("cls_positions", shape[-1]))
        return fields


class ImageClassificationTask(_LabelLoss, Task):
    """Image classification (`tfm.models.vision.VisionEncoder` with the "classification" head).

    Batch: images [B, H, W, C] float; label [B]; optional weights [B] (0 = a padding row).
    """

    def model_kwargs(self, batch):
        return {"images": batch["images"]}

    def num_tokens(self, batch):
        return int(batch["images"].shape[0])  # images, not patches

    def id_fields(self, config, batch):
        return [IdField("label", config.num_labels, "weights")]


@dataclasses.dataclass(frozen=True)
class ContrastiveTask(Task):
    """InfoNCE with in-batch negatives (E5 / sentence embeddings), for an EncoderModel with the
    "mean_pool" head (L2-normalised embeddings).

    Batch: query_ids, query_mask, doc_ids, doc_mask [B, T] (mask 1 = token, 0 = padding): row i's
    document is query i's positive and every other row's document a negative, so the loss is
    cross-entropy over the similarities q_i . d_j / temperature with target j = i. Queries and
    documents go through the model in one call, stacked on the batch axis. The negatives are the
    rows of the (micro)batch the loss sees; "accuracy" is the share of queries whose own
    document scores highest.
    """

    temperature: float = 0.05
    term = "contrastive"
    reads = ("z_loss",)

    def __post_init__(self):
        super().__post_init__()
        if self.temperature <= 0:
            raise ValueError(f"ContrastiveTask.temperature must be > 0, got {self.temperature}")

    def model_kwargs(self, batch):
        if batch["query_ids"].shape != batch["doc_ids"].shape:
            raise ValueError(f"ContrastiveTask needs query_ids and doc_ids of one shape; got "
                             f"{batch['query_ids'].shape} and {batch['doc_ids'].shape}")
        stack = lambda a, b: jnp.concatenate([jnp.asarray(a), jnp.asarray(b)], axis=0)
        return {"tokens": stack(batch["query_ids"], batch["doc_ids"]),
                "segment_ids": stack(batch["query_mask"], batch["doc_mask"]).astype(jnp.int32)}

    def weights(self, batch):
        return {self.term: jnp.ones(batch["query_ids"].shape[:1], jnp.float32)}

    def loss_terms(self, out, batch):
        B = batch["query_ids"].shape[0]
        queries, docs = out.embedding[:B], out.embedding[B:]  # [B, D] each
        similarity = jnp.einsum("QD,KD->QK", queries, docs) / self.temperature
        return {self.term: cross_entropy(similarity, jnp.arange(B), self.weights(batch)[self.term],
                                         z_loss=self.z_loss)}

    def num_tokens(self, batch):
        return int(batch["query_ids"].size + batch["doc_ids"].size)

    def id_fields(self, config, batch):
        return [IdField("query_ids", config.vocab_size), IdField("doc_ids", config.vocab_size)]
