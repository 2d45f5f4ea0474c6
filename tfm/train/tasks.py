"""Tasks: how a batch feeds a model and which losses it yields, one class per family.

Batches are dicts of fixed-shape arrays with the batch on dim 0:
  LMTask (DecoderLM)          inputs, targets [B, T]; optional weights, segment_ids, positions.
  MLMTask (EncoderModel)      input_ids, token_type_ids, attention_mask [B, T] (1 = token);
                              mlm_positions, mlm_ids, mlm_weights [B, P]; nsp_label [B]
                              (the keys of `tfm.data.pretraining`).
  Seq2SeqTask (EncoderDecoder) inputs [B, S]; targets_in, targets [B, T]; optional weights,
                              {inputs,targets}_{segment_ids,positions}.

`loss` returns the objective of one (micro)batch with every sum already divided by the
full batch's totals, so summing microbatch results gives exactly the full-batch value.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfm.train.losses import cross_entropy


@dataclasses.dataclass(frozen=True)
class Task:
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    moe_aux_weight: float = 1.0  # multiplies the sown loss (the model applies its router coefficient)

    # --- per family -------------------------------------------------------------------
    def model_kwargs(self, batch: dict) -> dict:
        raise NotImplementedError

    def loss_terms(self, outputs, batch: dict) -> dict[str, dict]:
        """name -> cross_entropy() sums; the first term names "accuracy"."""
        raise NotImplementedError

    def num_tokens(self, batch: dict) -> int:
        """Tokens the model processes per batch (for tokens/s)."""
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------
    def init_variables(self, model, rng, batch: dict):
        return model.init({"params": rng, "dropout": rng}, **self.model_kwargs(batch),
                          deterministic=True)

    def forward(self, model, params, batch, rng, deterministic: bool):
        """(model outputs, summed MoE auxiliary loss; 0 without MoE)."""
        outputs, extra = model.apply({"params": params}, **self.model_kwargs(batch),
                                     deterministic=deterministic, rngs={"dropout": rng},
                                     mutable=["losses"])
        aux = sum((jnp.sum(x) for x in jax.tree.leaves(extra.get("losses", {}))),
                  jnp.zeros((), jnp.float32))
        return outputs, aux

    def loss(self, model, params, batch, rng, totals: dict, num_micro: int = 1,
             deterministic: bool = False):
        """(objective, metrics) for a (micro)batch; totals from `weight_totals(full batch)`."""
        outputs, aux = self.forward(model, params, batch, rng, deterministic)
        terms = self.loss_terms(outputs, batch)
        objective = self.moe_aux_weight * aux / num_micro
        metrics = {"loss": 0.0, "z_loss": 0.0, "moe_aux_loss": aux / num_micro}
        for i, (name, t) in enumerate(terms.items()):
            norm = totals[name]
            objective += (t["ce"] + t["z"]) / norm
            metrics["loss"] += t["ce"] / norm
            metrics["z_loss"] += t["z"] / norm
            if i == 0:
                metrics["accuracy"] = t["correct"] / norm
            if len(terms) > 1:
                metrics[f"{name}_loss"] = t["ce"] / norm
                metrics[f"{name}_accuracy"] = t["correct"] / norm
        return objective, metrics

    def weight_totals(self, batch: dict) -> dict:
        return {name: jnp.maximum(jnp.sum(w.astype(jnp.float32)), 1.0)
                for name, w in self.weights(batch).items()}

    def weights(self, batch: dict) -> dict:
        raise NotImplementedError

    def _ce(self, logits, targets, weights):
        return cross_entropy(logits, targets, weights, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss)


def _weights_or_ones(batch, key, like):
    return batch[key] if key in batch else jnp.ones(batch[like].shape, jnp.float32)


class LMTask(Task):
    def model_kwargs(self, batch):
        return {"tokens": batch["inputs"], "segment_ids": batch.get("segment_ids"),
                "positions": batch.get("positions")}

    def weights(self, batch):
        return {"lm": _weights_or_ones(batch, "weights", "targets")}

    def loss_terms(self, logits, batch):
        return {"lm": self._ce(logits, batch["targets"], self.weights(batch)["lm"])}

    def num_tokens(self, batch):
        return int(batch["inputs"].size)


class MLMTask(Task):
    def model_kwargs(self, batch):
        mask = batch.get("attention_mask")
        return {"tokens": batch["input_ids"], "token_type_ids": batch.get("token_type_ids"),
                "segment_ids": None if mask is None else mask.astype(jnp.int32),
                "mlm_positions": batch["mlm_positions"]}

    def weights(self, batch):
        return {"mlm": _weights_or_ones(batch, "mlm_weights", "mlm_ids"),
                "nsp": jnp.ones(batch["nsp_label"].shape, jnp.float32)}

    def loss_terms(self, out, batch):
        w = self.weights(batch)
        return {"mlm": self._ce(out["mlm_logits"], batch["mlm_ids"], w["mlm"]),
                "nsp": cross_entropy(out["nsp_logits"], batch["nsp_label"], w["nsp"])}

    def num_tokens(self, batch):
        return int(batch["input_ids"].size)


class Seq2SeqTask(Task):
    def model_kwargs(self, batch):
        kw = {"inputs": batch["inputs"], "targets_in": batch["targets_in"]}
        for side in ("inputs", "targets"):
            for what in ("segment_ids", "positions"):
                kw[f"{side}_{what}"] = batch.get(f"{side}_{what}")
        return kw

    def weights(self, batch):
        return {"lm": _weights_or_ones(batch, "weights", "targets")}

    def loss_terms(self, logits, batch):
        return {"lm": self._ce(logits, batch["targets"], self.weights(batch)["lm"])}

    def num_tokens(self, batch):
        return int(batch["inputs"].size + batch["targets"].size)
