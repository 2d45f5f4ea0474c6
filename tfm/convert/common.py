"""Shared pieces of the Hugging Face import and export: reading HF config fields with clear errors,
tracking which checkpoint tensors were used, the layout changes every family needs, the param
tree they share (`model_params`), and the helpers of the config writers (`hf_activation`, `hf_rope`).

Torch layouts: `nn.Linear.weight` is [out, in]; tfm's `Einsum` kernels are [in, out] with the
head axes split out: query [D, N, H], key/value [D, K, H], out [N, H, D].
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence

import jax
import numpy as np

from tfm.config import ModelConfig, RopeConfig


class ConversionError(ValueError):
    """A checkpoint or config that tfm cannot convert faithfully (a ValueError)."""


@dataclasses.dataclass(frozen=True)
class Converter:
    """How one HF architecture maps onto tfm: its model class, config and params."""

    model_class: type
    config: Callable[["HFConfig"], object]  # -> tfm ModelConfig
    params: Callable[["Weights", object], dict]  # (checkpoint tensors, tfm config) -> param tree
    ignore: Sequence[str] = ()  # glob patterns of tensors that carry no parameters
    # Export (tfm.convert.export): (tfm config) -> HF config dict with "model_type", the inverse of
    # `config`; None = this architecture does not export.
    hf_config: Optional[Callable[[object], dict]] = None
    # (tfm config, checkpoint tensors) -> the config, with what only the tensors tell (a BertModel
    # saved without its pooler); None = the HF config says everything. Import only.
    refine: Optional[Callable[[object, "Weights"], object]] = None
    # HF config fields `config` does not read because they change nothing tfm computes (beyond COMMON_INERT);
    # any other unread field is refused (HFConfig.check_read).
    inert: Sequence[str] = ()
    # Export tries the writable classes in (export_rank, architecture's module) order: a family whose config
    # generalises another's (Granite's multipliers over Llama's) ranks after it, so a Llama exports as a Llama.
    export_rank: int = 0
    # Export: (the HF config object, the tensors written so far) -> the tensors HF keeps in its state dict but
    # derives from others (MiniMax's decays from its slopes), each matching an `ignore` pattern, which
    # import skips; None = every HF tensor comes from a tfm param.
    derived: Optional[Callable[[object, dict], dict]] = None

    def read_config(self, fields: dict, architecture: str):
        """The tfm config of the HF config `fields`; refuses any field it neither reads nor knows inert."""
        hf = HFConfig(fields, architecture)
        try:
            config = self.config(hf)
        except ConversionError:
            raise
        except ValueError as e:  # the fields make no valid tfm config (say, another family's forced onto it)
            raise ConversionError(f"{architecture}: {e}") from None
        hf.check_read(self.inert)
        return config


# HF activation names -> tfm activation names (tfm "gelu" is exact erf GELU, "gelu_tanh" the tanh one).
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "relu": "relu",
    "relu2": "relu2",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}
# tfm's gated variants use silu (swiglu) and tanh-GELU (geglu) gates.
GATED_ACTIVATIONS = {"silu": "swiglu", "gelu_tanh": "geglu", "gelu": "geglu_erf"}


# Fields every transformers config carries that change no computed value: bookkeeping, output switches,
# generation's token ids, initialisation, caching. A converter reads the rest or declares them inert.
COMMON_INERT = ("_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
                "label2id", "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states",
                "problem_type", "return_dict", "transformers_version", "bos_token_id", "eos_token_id",
                "decoder_start_token_id", "sep_token_id", "cls_token_id", "initializer_range", "initializer_factor",
                "init_std", "use_cache", "tokenizer_class", "task_specific_params", "prefix", "gradient_checkpointing",
                "_attn_implementation_autoset", "auto_map", "quantization_config", "pretraining_tp",
                "output_router_logits", "router_jitter_noise", "tie_encoder_decoder")


class HFConfig:
    """Read-only view of an HF config dict that names the architecture and field in errors, and
    records which fields were read (`read`), so that `check_read` can refuse any it did not."""

    def __init__(self, fields: dict, architecture: str, read: Optional[set] = None):
        self.fields = dict(fields)
        self.architecture = architecture
        self.read = set() if read is None else read

    def _value(self, name: str, default=None):
        self.read.add(name)
        return self.fields.get(name, default)

    def has(self, name: str) -> bool:
        """Whether the field is present (it counts as read)."""
        self.read.add(name)
        return name in self.fields

    def with_fields(self, **changes) -> "HFConfig":
        """A view with `changes` laid over the fields, recording reads into this one's `read`."""
        return HFConfig({**self.fields, **changes}, self.architecture, self.read)

    def get(self, name: str, default=None):
        value = self._value(name)
        return default if value is None else value

    def require(self, name: str):
        if self._value(name) is None:
            raise ConversionError(f"{self.architecture}: config field {name!r} is missing")
        return self.fields[name]

    def expect(self, name: str, allowed: Sequence, default=None):
        """The field's value, which must be one of `allowed` (absent = default)."""
        value = self._value(name, default)
        if value not in allowed:
            raise self.unsupported(name, value, f"tfm supports {list(allowed)}")
        return value

    def unsupported(self, name: str, value, detail: str = "") -> ConversionError:
        msg = f"{self.architecture}: unsupported config field {name}={value!r}"
        return ConversionError(msg + (f"; {detail}" if detail else ""))

    def same(self, *names: str):
        """Fields that tfm keeps as one value (e.g. encoder and decoder widths) must agree."""
        values = {n: self.require(n) for n in names}
        if len(set(values.values())) != 1:
            raise ConversionError(f"{self.architecture}: unsupported config: tfm needs "
                                  f"{' == '.join(names)}, got {values}")
        return values[names[0]]

    def activation(self, name: str, default: Optional[str] = None, gated: bool = False) -> str:
        value = self._value(name, default)
        act = HF_ACTIVATIONS.get(value)
        if gated:
            act = GATED_ACTIVATIONS.get(act)
        if act is None:
            allowed = [k for k, v in HF_ACTIVATIONS.items() if not gated or v in GATED_ACTIVATIONS]
            raise self.unsupported(name, value, f"tfm maps {allowed}")
        return act

    def pad_id(self, vocab_size: int) -> int:
        pad = self._value("pad_token_id")
        return pad if isinstance(pad, int) and 0 <= pad < vocab_size else 0

    def check_read(self, inert: Iterable[str] = ()):
        """Refuses the first field (set, not None) that the converter neither read nor declared `inert`
        (nor COMMON_INERT): a field the converter does not know may change the model, and ignoring it
        would give wrong logits without a word."""
        known = self.read | set(inert) | set(COMMON_INERT)
        unread = sorted(k for k, v in self.fields.items() if v is not None and k not in known)
        if unread:
            more = f" (and {', '.join(unread[1:])})" if len(unread) > 1 else ""
            raise ConversionError(f"{self.architecture}: config field {unread[0]}={self.fields[unread[0]]!r}{more} "
                                  f"is not read by tfm's {self.architecture} converter, and it may change the "
                                  f"model; convert with the architecture that has it, or tell tfm's converter "
                                  f"what it means")


class Weights:
    """Checkpoint tensors by HF name; remembers which were used so that nothing is dropped silently.

    `ignore` holds glob patterns of tensors that carry no parameters (causal-mask buffers,
    position ids, rotary caches) or that tfm deliberately does not keep.
    """

    def __init__(self, tensors: Dict[str, np.ndarray], source: str, ignore: Iterable[str] = ()):
        self.tensors = {_legacy_name(k): v for k, v in tensors.items()}
        self.source = source
        self.ignore = tuple(ignore)
        self.used = set()

    def has(self, key: str) -> bool:
        return key in self.tensors

    def __call__(self, key: str, shape: Optional[Sequence[int]] = None) -> np.ndarray:
        if key not in self.tensors:
            raise ConversionError(f"{self.source}: checkpoint lacks tensor {key!r}")
        value = self.tensors[key]
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ConversionError(f"{self.source}: tensor {key!r} has shape {tuple(value.shape)}, "
                                  f"the config implies {tuple(shape)}")
        if key not in self.used:
            self._check_finite(key, value)
        self.used.add(key)
        return value

    def _check_finite(self, key: str, value: np.ndarray):
        if not np.issubdtype(value.dtype, np.floating):
            return
        finite = np.isfinite(value)
        if finite.all():
            return
        first = np.unravel_index(np.argmin(finite), value.shape)
        raise ConversionError(f"{self.source}: tensor {key!r} holds {value.size - int(finite.sum())} non-finite "
                              f"value(s), the first {value[first]} at index {tuple(int(i) for i in first)}; "
                              f"the checkpoint is corrupt or overflowed when it was saved")

    def optional(self, key: str) -> Optional[np.ndarray]:
        return self(key) if self.has(key) else None

    def tied(self, key: str, reference: np.ndarray, field: str):
        """A tensor the config declares tied to `reference`: absent (as saved) or equal to it."""
        if not self.has(key):
            return
        value = self(key)
        if value.shape != reference.shape or not np.array_equal(value, reference):
            raise ConversionError(f"{self.source}: {field} says {key!r} is tied, but its values differ "
                                  f"from the tensor it should share; fix {field} in the config")

    def strip_prefix(self, prefix: str):
        """Accept checkpoints saved with or without a wrapper prefix (e.g. 'bert.')."""
        if self.tensors and all(k.startswith(prefix) for k in self.tensors if not self._ignored(k)):
            self.tensors = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in self.tensors.items()}

    def _ignored(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for p in self.ignore)

    def finish(self):
        unused = sorted(k for k in self.tensors if k not in self.used and not self._ignored(k))
        if unused:
            shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
            raise ConversionError(f"{self.source}: tensors with no tfm counterpart (unsupported variant?): "
                                  f"{shown}")


def _legacy_name(key: str) -> str:
    """Old TF-era LayerNorm names (gamma/beta) -> weight/bias, as transformers' loader does."""
    if key.endswith(".gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith(".beta"):
        return key[: -len("beta")] + "bias"
    return key


# ---- layouts ------------------------------------------------------------------------------

def dense(weight: np.ndarray, bias: Optional[np.ndarray] = None) -> dict:
    """torch Linear weight [out, in] (+ bias [out]) -> Einsum {"kernel": [in, out], "bias"}."""
    out = {"kernel": weight.T}
    if bias is not None:
        out["bias"] = bias
    return out


def linear(w: Weights, prefix: str, bias: bool = True) -> dict:
    """`prefix.weight` / `prefix.bias` of a torch Linear as an Einsum param dict."""
    return dense(w(f"{prefix}.weight"), w(f"{prefix}.bias") if bias else None)


def conv1d(w: Weights, prefix: str):
    """GPT-style Conv1D (weight [in, out], bias) -> torch Linear layout (weight [out, in], bias)."""
    return w(f"{prefix}.weight").T, w(f"{prefix}.bias")


def add_output_head(params: dict, w: Weights, embedding, cfg, key: str = "lm_head.weight",
                    into: str = "output") -> None:
    """Adds the untied output projection params[into]["lm_head"] {"kernel": [D, V]} from `key`;
    with cfg.tie_embeddings adds nothing (HF's `key` must then equal `embedding`)."""
    if cfg.tie_embeddings:
        w.tied(key, embedding, "tie_word_embeddings")
    else:
        params.setdefault(into, {})["lm_head"] = {"kernel": w(key, (cfg.vocab_size, cfg.d_model)).T}


def norm(w: Weights, prefix: str, kind: str, bias: bool = True) -> dict:
    """LayerNorm (weight, bias unless bias=False) or RMSNorm (weight) -> Norm {"scale", "bias"}."""
    out = {"scale": w(f"{prefix}.weight")}
    if kind == "layernorm" and bias:
        out["bias"] = w(f"{prefix}.bias")
    return out


def attention(q, k, v, o, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """Projections in torch Linear layout, each (weight, bias-or-None) -> Attention params.

    q weight [N*H, D], k/v [K*H, D], o [D, N*H] -> query [D, N, H], key/value [D, K, H], out [N, H, D].
    """
    def heads_in(pair, n):
        weight, bias = pair
        out = {"kernel": weight.T.reshape(weight.shape[1], n, head_dim)}
        if bias is not None:
            out["bias"] = bias.reshape(n, head_dim)
        return out

    weight, bias = o
    out = {"kernel": weight.T.reshape(num_heads, head_dim, weight.shape[0])}
    if bias is not None:
        out["bias"] = bias
    return {"query": heads_in(q, num_heads), "key": heads_in(k, num_kv_heads),
            "value": heads_in(v, num_kv_heads), "out": out}


def linear_pair(w: Weights, prefix: str, bias: bool):
    return w(f"{prefix}.weight"), (w(f"{prefix}.bias") if bias else None)


def self_attention(w: Weights, p: str, cfg) -> dict:
    """`{p}.{q,k,v,o}_proj` (biases as cfg.attention_bias) -> an Attention's params."""
    qkvo = [linear_pair(w, f"{p}.{n}_proj", cfg.attention_bias) for n in ("q", "k", "v", "o")]
    return attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def hybrid_mixer(w: Weights, p: str, cfg, layer: int, mixer_params: Callable, at: str = "mamba") -> dict:
    """Layer `layer`'s token mixer in the layout Jamba and Bamba share: `input_layernorm` (RMSNorm), then
    `self_attn` (`self_attention`) where cfg.mixer_pattern says attention, else the linear-time mixer at
    `at` (`mixer_params(w, prefix, cfg)`; MiniMax keeps it at `self_attn`)."""
    if cfg.layer_mixer(layer) == "attention":
        return {"attn_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
                "self_attn": self_attention(w, f"{p}.self_attn", cfg)}
    return {"mixer_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"), "mixer": mixer_params(w, f"{p}.{at}", cfg)}


def period(kinds: Sequence) -> tuple:
    """The shortest prefix of `kinds` whose repeats give all of it (its length divides len(kinds)): HF's per-layer
    lists as tfm's repeating patterns."""
    kinds = tuple(kinds)
    n = len(kinds)
    return next(kinds[:p] for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))


def stack_layers(layers: Sequence[dict], scan: bool, period: int = 1, unscanned: int = 0) -> dict:
    """Per-layer param dicts -> `layer_0..` or, for scanned stacks, the first `unscanned` as `layer_i`
    and the rest as `layers` stacked on axis 0 (with an attention pattern of period P > 1:
    `layers/layer_j` stacks layers j, j + P, ... of the rest)."""
    if not scan:
        return {f"layer_{i}": p for i, p in enumerate(layers)}
    out = {f"layer_{i}": p for i, p in enumerate(layers[:unscanned])}
    rest = layers[unscanned:]
    stack = lambda group: jax.tree.map(lambda *xs: np.stack(xs), *group)
    if period == 1:
        return {**out, "layers": stack(rest)}
    return {**out, "layers": {f"layer_{j}": stack(rest[j::period]) for j in range(period)}}


@dataclasses.dataclass(frozen=True)
class Stack:
    """One stack of blocks in a checkpoint, for `model_params`."""

    layer: Callable[[int], dict]  # i -> the params of layer i
    num_layers: int
    final_norm: Optional[str] = None  # HF prefix of the norm after the last layer; None = none
    norm_kind: Optional[str] = None  # that norm's kind; None = cfg.norm
    extra: Optional[Mapping[str, dict]] = None  # the stack's other params (T5's relative bias table)


def model_params(w: Weights, cfg, *, embedding: str, stacks: Mapping[str, Stack],
                 head: Optional[str] = "lm_head.weight", tied: Sequence[str] = (), **extra) -> dict:
    """The param tree every family shares: the token embedding `embedding` [V (+ extra tokens), D] (`tied`: copies of
    it the checkpoint may hold, e.g. each side's embed_tokens), the family's `extra` top-level params
    (input norms and positions, output bias, heads), each stack's layers (scanned or not, in groups of
    cfg.pattern_period) with its final norm, and the output projection `head` (tied to the embedding
    under cfg.tie_embeddings; None = no output projection)."""
    embed = w(embedding, (cfg.vocab_size + cfg.multimodal.extra_tokens, cfg.d_model))
    for key in tied:
        w.tied(key, embed, "the shared embedding")
    out = {"embed": {"embedding": embed}, **extra, **stack_params(w, cfg, stacks)}
    if head is not None:
        add_output_head(out, w, embed, cfg, head)
    return out


def stack_params(w: Weights, cfg, stacks: Mapping[str, Stack]) -> dict:
    """{name: the stack's layers (scanned or not, in groups of cfg.pattern_period), extra params and final norm}."""
    out = {}
    for name, s in stacks.items():
        layers = [s.layer(i) for i in range(s.num_layers)]
        out[name] = {**stack_layers(layers, cfg.execution.scan_layers, cfg.pattern_period, cfg.dense_layers),
                     **(s.extra or {})}
        if s.final_norm is not None:
            out[name]["final_norm"] = norm(w, s.final_norm, s.norm_kind or cfg.norm, cfg.norm_bias)
    return out


def rope(hf: HFConfig, default_theta: float, partial: bool = False) -> RopeConfig:
    """RoPE fields of an HF config (v5 `rope_parameters` or legacy `rope_theta`/`rope_scaling`)
    -> ModelConfig.rope (a RopeConfig): default, linear, dynamic, llama3 and yarn scaling, and
    (partial=True, for families whose HF model rotates part of each head) partial_rotary_factor as dim."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    scaling = {**legacy, **params}
    key = "rope_type" if "rope_type" in scaling else "type"
    kind = scaling.get(key) or "default"
    field = f"{'rope_parameters' if params else 'rope_scaling'}.{key}"
    max_len = hf.get("max_position_embeddings")
    original = scaling.get("original_max_position_embeddings") or max_len
    out = dict(theta=float(theta))
    if kind == "linear":
        out.update(scaling="linear", factor=float(scaling["factor"]))
    elif kind == "dynamic":  # HF stretches past max_position_embeddings itself
        out.update(scaling="dynamic", factor=float(scaling["factor"]), original_max_len=max_len)
    elif kind == "llama3":
        out.update(scaling="llama3", factor=float(scaling["factor"]),
                   low_freq_factor=float(scaling["low_freq_factor"]),
                   high_freq_factor=float(scaling["high_freq_factor"]),
                   original_max_len=int(scaling["original_max_position_embeddings"]))
    elif kind == "yarn":
        factor = scaling.get("factor") or max_len / original
        out.update(scaling="yarn", factor=float(factor), original_max_len=int(original),
                   beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                   truncate=bool(scaling.get("truncate", True)),
                   attention_factor=_yarn_attention_factor(scaling, factor))
    elif kind != "default":
        raise hf.unsupported(field, kind, "tfm maps 'default', 'linear', 'dynamic', 'llama3' and 'yarn'")
    unknown = sorted(set(scaling) - ROPE_KEYS)
    if unknown:
        raise hf.unsupported(f"rope_parameters.{unknown[0]}", scaling[unknown[0]],
                             f"tfm reads {sorted(ROPE_KEYS)} (per-layer-type RoPE: common.layer_ropes)")
    fraction = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if fraction != 1.0:
        if not partial:
            raise hf.unsupported("partial_rotary_factor", fraction, f"{hf.architecture} rotates the whole head")
        head_dim = hf.get("head_dim") or hf.require("hidden_size") // hf.require("num_attention_heads")
        out["dim"] = int(head_dim * fraction)
    return RopeConfig(**out)


ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
             "high_freq_factor", "beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim",
             "partial_rotary_factor"}
LAYER_ROPES = ("full_attention", "sliding_attention")  # rope_parameters keyed by layer type (Gemma 3, OLMo 3)


def layer_ropes(hf: HFConfig, default_theta: float, partial: bool = False) -> dict:
    """ModelConfig's rope and local_rope from rope_parameters given per layer type ({"full_attention": ...,
    "sliding_attention": ...}, as the model reads them; flat keys beside them are not read by HF's model), or
    from a flat one (local_rope None)."""
    params = hf.get("rope_parameters") or {}
    per = {k: v for k, v in params.items() if isinstance(v, Mapping)}
    if not per:
        return dict(rope=rope(hf, default_theta, partial))
    if set(per) - set(LAYER_ROPES):
        raise hf.unsupported("rope_parameters", sorted(per), f"tfm reads one RoPE per layer type of {list(LAYER_ROPES)}")
    full, local = (rope(hf.with_fields(rope_parameters=per.get(kind, per.get("full_attention"))), default_theta,
                        partial) for kind in LAYER_ROPES)
    return dict(rope=full, local_rope=None if local == full else local)


def hf_layer_ropes(cfg: ModelConfig) -> dict:
    """The inverse of `layer_ropes`: rope_parameters per layer type."""
    local = cfg.replace(rope=cfg.local_rope) if cfg.local_rope is not None else cfg
    return {"rope_parameters": {"full_attention": hf_rope(cfg)["rope_parameters"],
                                "sliding_attention": hf_rope(local)["rope_parameters"]}}


def _yarn_attention_factor(scaling: dict, factor: float) -> Optional[float]:
    """yarn's cos/sin factor as HF derives it: given, or from mscale / mscale_all_dim; None leaves
    tfm's default (0.1 ln(factor) + 1)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        return None
    m = lambda scale: 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0
    return float(m(mscale) / m(mscale_all_dim))


def split_qkv(weight: np.ndarray, bias: Optional[np.ndarray], num_heads: int, per_head: bool):
    """A fused q/k/v torch Linear (weight [3*N*H, D], bias [3*N*H] or None) -> three (weight, bias)
    pairs in Linear layout. per_head=False: q, k, v one after another (MPT, GPT-1/GPT-2);
    True: interleaved per head as [N, 3, H] (GPT-NeoX, BLOOM)."""
    D = weight.shape[1]
    if per_head:
        w = weight.reshape(num_heads, 3, -1, D)
        b = None if bias is None else bias.reshape(num_heads, 3, -1)
        return [(w[:, i].reshape(-1, D), None if b is None else b[:, i].reshape(-1)) for i in range(3)]
    biases = [None] * 3 if bias is None else np.split(bias, 3)
    return list(zip(np.split(weight, 3, axis=0), biases))


# ---- helpers for config writers -----------------------------------------------------------

def hf_activation(activation: str, gated: bool = False) -> str:
    """tfm activation -> the HF `hidden_act` name that imports back to it (gated: the gate's)."""
    for hf_name, tfm_name in HF_ACTIVATIONS.items():
        if (GATED_ACTIVATIONS.get(tfm_name) if gated else tfm_name) == activation:
            return hf_name
    kinds = sorted(GATED_ACTIVATIONS.values()) if gated else sorted(set(HF_ACTIVATIONS.values()))
    raise ConversionError(f"activation={activation!r} has no Hugging Face name here; it writes {kinds}")


def hf_rope(cfg: ModelConfig) -> dict:
    """RoPE fields as transformers 5 `rope_parameters` (default, linear, dynamic, llama3, yarn)."""
    params = {"rope_type": cfg.rope.scaling or "default", "rope_theta": float(cfg.rope.theta)}
    if cfg.rope.scaling is not None:
        params["factor"] = float(cfg.rope.factor)
    if cfg.rope.scaling in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = cfg.rope.original_max_len
    if cfg.rope.scaling == "llama3":
        params.update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor)
    elif cfg.rope.scaling == "yarn":
        params.update(beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow, truncate=cfg.rope.truncate)
        if cfg.rope.attention_factor is not None:
            params["attention_factor"] = cfg.rope.attention_factor
    elif cfg.rope.scaling not in (None, "linear", "dynamic"):
        raise ConversionError(f"rope.scaling={cfg.rope.scaling!r} has no Hugging Face rope_type")
    return {"rope_parameters": params}
