"""Logical-axis rule sets: which mesh axes each logical name is sharded over.

Modules name their axes logically ("embed", "heads", "mlp", "vocab", "expert", "batch", …);
a rule set maps those names to mesh axes. Parallelism styles are rule sets, combined by
name, e.g. `make_rules("fsdp", "tensor")`:

  data    batch over `data`; params replicated.
  fsdp    batch over `fsdp`; params and optimizer state sharded over `fsdp` on "embed", and on
          "latent" (multi-head latent attention's compressed width) where "embed" is absent:
          MLA's up-projections [C, N, H] have no "embed" dim.
  tensor  Megatron: "heads"/"kv_heads"/"mlp" over `tensor` — the QKV and up projections are
          column-parallel (output dim split), the attention-out and down projections
          row-parallel (input dim split); the vocab table and logits split on "vocab".
  context sequences ("length") over `context` (context parallelism, `tfm.ops.context`), and
          params and optimizer state over `context` on "embed" (and "latent") as fsdp does over `fsdp`: the
          devices of a context group hold different tokens of the same rows, so like FSDP
          ranks they sum gradients and need no whole copy of the model (MaxText shards its
          parameters over its context axis the same way). Under fsdp+context "embed" is split
          over both, so a long-context mesh holds 1/(fsdp x context) of the state per device.
  expert  batch and the "expert" dim of MoE weights over `expert`; with fsdp, params and optimizer
          state over `expert` on "embed" (and "latent") too, beside `fsdp`: `expert` splits the batch,
          so under FSDP its devices hold different rows and sum gradients like fsdp ranks; sharding
          the params over it makes that sum a reduce-scatter (each device keeps its shard) where
          replicated params took a whole all-reduce of every gradient shard over `expert`. Weights
          with an "expert" dim keep `expert` on it (one axis per array). Inside the MoE layer
          (moe_impl="einsum") the dispatched activations [B, E, C, D] name their batch
          "expert_batch" (the batch axes less `expert`), so E is split over `expert` and XLA
          moves tokens all-to-all. moe_impl="ragged" sends each token to its experts' devices
          by all-to-all inside shard_map (`tfm.parallel.experts`).

The KV cache of decoding is named "cache_batch" (cross-attention's: "cache_memory_batch"; both
the batch axes, as "batch"), "cache_kv_heads"
(as "kv_heads"; a linear-time mixer's recurrent state "cache_heads", as "heads") and "cache_length" (no rule: every device holds the whole cache length), so
a decode under a mesh keeps the cache sharded like the activations it came from.

Parameter rules and activation rules differ in two places: "embed" and "latent" are
FSDP-sharded in parameters only (activations keep those widths whole; their batch already
uses `fsdp`), and "length" is split over `context` in activations only.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional, Sequence

from tfm.parallel.mesh import AXES

Rules = tuple[tuple[str, tuple[str, ...]], ...]

RULE_SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "data": {"batch": ("data",)},
    "fsdp": {"batch": ("fsdp",), "embed": ("fsdp",), "latent": ("fsdp",)},
    "tensor": {"heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",),
               "vocab": ("tensor",), "cache_kv_heads": ("tensor",),
               "cache_heads": ("tensor",)},
    "expert": {"batch": ("expert",), "expert": ("expert",)},
    "context": {"length": ("context",), "embed": ("context",), "latent": ("context",)},
}
_PARAM_ONLY = ("embed", "latent")
_ACTIVATION_ONLY = ("length",)


def make_rules(*styles: str, activations: bool = False) -> Rules:
    """Union of the named rule sets; a name mapped by several sets uses all their axes in
    mesh order (so "batch" under data+fsdp+expert is ("data", "fsdp", "expert"))."""
    styles = styles or ("data",)
    unknown = [s for s in styles if s not in RULE_SETS]
    if unknown:
        raise ValueError(f"unknown parallelism {unknown}; choose from {sorted(RULE_SETS)}")
    merged: dict[str, set[str]] = {}
    for style in styles:
        for name, axes in RULE_SETS[style].items():
            merged.setdefault(name, set()).update(axes)
    if "batch" not in merged:  # every style is at least data parallel over its batch axis
        merged["batch"] = {"data"}
    merged["batch"].add("data")
    if "fsdp" in styles and "expert" in styles:  # FSDP: params sharded over every axis the batch is
        for name in _PARAM_ONLY:
            merged[name].add("expert")
    merged["expert_batch"] = merged["batch"] - {"expert"}
    merged["cache_batch"] = set(merged["batch"])
    merged["cache_memory_batch"] = set(merged["batch"])
    for name in _PARAM_ONLY if activations else _ACTIVATION_ONLY:
        merged.pop(name, None)
    return tuple((name, tuple(a for a in AXES if a in axes)) for name, axes in merged.items())


_PARAM_RULES: contextvars.ContextVar[Optional[Rules]] = contextvars.ContextVar("tfm_param_rules", default=None)


@contextlib.contextmanager
def param_rules(rules: Rules):
    """While tracing a model (beside the activation rules of `flax.linen.logical_axis_rules`): the
    rules its parameters are sharded by, for code that must know a weight's layout inside the step
    (`tfm.layers.embeddings.sharded_lookup`). `Trainer.context` sets it."""
    token = _PARAM_RULES.set(rules)
    try:
        yield
    finally:
        _PARAM_RULES.reset(token)


def active_param_rules() -> Optional[Rules]:
    """The rules `param_rules` made current, or None."""
    return _PARAM_RULES.get()


def parse_parallelism(spec: str | Sequence[str]) -> tuple[str, ...]:
    """"fsdp+tensor" or ("fsdp", "tensor") -> ("fsdp", "tensor")."""
    parts = spec.split("+") if isinstance(spec, str) else list(spec)
    return tuple(p.strip() for p in parts if p.strip())


def flax_rules(rules: Rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """The same rules in the form `flax.linen.logical_axis_rules` takes."""
    return tuple((name, axes if len(axes) > 1 else (axes[0] if axes else None))
                 for name, axes in rules)


def from_flax_rules(rules) -> Rules:
    """Rules in the form `flax.linen.logical_axis_rules` takes (a name may map to one mesh
    axis, several, or None) back to `Rules`; the first rule for a name wins, as in flax."""
    table: dict[str, tuple[str, ...]] = {}
    for name, axes in rules or ():
        table.setdefault(name, (axes,) if isinstance(axes, str) else tuple(axes or ()))
    return tuple(table.items())
