"""Frozen, validated model configuration shared by every family.

One `ModelConfig` describes a stack of identical `Block`s plus embeddings and heads; the
family (encoder, decoder-only, encoder-decoder) is the model class that consumes it. Its fields
say what the model computes; how a run executes it (compute dtype, scan, remat, attention and
MoE implementations, kernel tiles) is the nested `ExecutionConfig` (`config.execution`), whose
fields are the one list of such settings. RoPE's settings are one nested `RopeConfig`
(`config.rope.theta`); fields left None to be derived (num_kv_heads, head_dim,
num_decoder_layers, rope.dim) hold their value once built. Impossible combinations raise
`ValueError` naming the field. Which backend supports which feature is `tfm.capabilities`'.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple, Union

from tfm import capabilities
from tfm.kernels import sparsity as sparsity_lib
from tfm.kernels.tiles import BlockSizes

NORMS = ("layernorm", "rmsnorm")
# Where a sublayer's norm sits: "pre" x + f(n(x)); "post" n(x + f(x)) (the original Transformer, BERT);
# "sandwich" x + n2(f(n(x))) (Gemma 2/3, GLM-4); "post_sublayer" x + n(f(x)) (OLMo 2/3)
NORM_POSITIONS = ("pre", "post", "sandwich", "post_sublayer", "normed_residual")
LAYER_POSITIONS = ("rope", "none")  # ModelConfig.position_pattern entries
QK_NORM_SCOPES = ("head", "heads")  # ModelConfig.qk_norm_scope
QK_NORM_POSITIONS = ("before_rope", "after_rope")  # ModelConfig.qk_norm_position
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative", "none")
ROPE_SCALINGS = (None, "linear", "ntk", "llama3", "yarn", "dynamic")
# ModelConfig.attention_pattern entries: every earlier key, a sliding window, aligned spans (attention_span)
ATTENTION_KINDS = ("global", "local", "span")
# ModelConfig.ffn_pattern entries: a layer's feed-forward ("rwkv": RWKV's channel mix; "none": a mixer only),
# and those tfm.layers.slot registers
FFN_KINDS = ("dense", "moe", "rwkv", "none")
# relu2: relu(x)**2; geglu gates by the tanh GELU, geglu_erf by the exact one (Zamba2); swiglu_clamped: gpt-oss's
# (g * sigmoid(alpha g)) * (u + 1), g and u clamped (swiglu_limit)
ACTIVATION_NAMES = ("relu", "relu2", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_erf", "swiglu_clamped")
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_tanh", "geglu_erf": "gelu", "swiglu_clamped": "silu"}
DTYPE_NAMES = ("float32", "bfloat16", "float16")
ROUTER_SCORES = ("softmax", "sigmoid")  # ModelConfig.router_score
EMBEDDING_IMPLS = ("auto", "sharded", "xla")
REMAT_POLICY_NAMES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
HEADS = ("mlm", "nsp", "classification", "pooler", "mean_pool", "regression", "span")
# ModelConfig's regularisation: it changes training, not the function a trained model computes.
REGULARISATION = ("dropout_rate", "attention_dropout")


class _FieldGroup:
    """A frozen group of ModelConfig fields (ModelConfig.<FIELD>), given as itself or a dict of its fields."""

    FIELD = ""

    @classmethod
    def names(cls) -> tuple:
        """The group's field names."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def coerce(cls, value, base=None):
        """An instance from itself, or from a mapping of its fields laid over `base` (default: the defaults)."""
        if isinstance(value, cls):
            return value
        if value is None:
            return base or cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"ModelConfig.{cls.FIELD} must be a {cls.__name__} or a dict of its fields, got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"ModelConfig.{cls.FIELD} has no field(s) {unknown}; its fields are {names}")
        return dataclasses.replace(base or cls(), **value)


@dataclasses.dataclass(frozen=True)
class RopeConfig(_FieldGroup):
    """Rotary position embeddings (ModelConfig.rope, used with position="rope"): the base, the
    long-context scaling as Hugging Face's rope init functions define it, and which dims rotate.

    scaling: None, "linear" (position interpolation), "ntk" (base rescale), "dynamic" (NTK growing
      past original_max_len), "llama3" (Llama 3.1's wavelength band), "yarn" (Peng et al. 2023).
    """

    theta: float = 10_000.0  # the base of the frequencies theta^(-2i / dim)
    scaling: Optional[str] = None
    factor: float = 1.0  # the scaling's stretch
    original_max_len: Optional[int] = None  # llama3 / yarn / dynamic: the pretraining context length
    low_freq_factor: float = 1.0  # llama3: the interpolated wavelength band
    high_freq_factor: float = 4.0  # llama3: the band's other end
    beta_fast: float = 32.0  # yarn: the ramp between original and interpolated frequencies
    beta_slow: float = 1.0  # yarn: the ramp's other end
    truncate: bool = True  # yarn: the ramp's range rounded to whole dims (HF's truncate)
    attention_factor: Optional[float] = None  # yarn's cos/sin factor; None = 0.1 ln(factor) + 1
    dim: Optional[int] = None  # rotate the first `dim` of each head (GPT-J, GPT-NeoX); None = the whole head
    interleaved: bool = False  # rotate pairs (0, 1), (2, 3), ... (GPT-J) instead of halves (Llama)

    CHOICES = dict(scaling=ROPE_SCALINGS)

    def __post_init__(self):
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"ModelConfig.rope.scaling={self.scaling!r} is not one of {ROPE_SCALINGS}")
        if self.theta <= 0:
            raise ValueError(f"ModelConfig.rope.theta must be > 0, got {self.theta}")
        if self.scaling is not None and self.factor < 1.0:
            raise ValueError(f"ModelConfig.rope.factor must be >= 1, got {self.factor}")
        if self.scaling in ("llama3", "yarn", "dynamic") and (self.original_max_len or 0) < 1:
            raise ValueError(f"ModelConfig.rope.scaling={self.scaling!r} needs rope.original_max_len "
                             f"(the pretraining context length), got {self.original_max_len}")
        if self.scaling == "llama3" and not 0 < self.low_freq_factor <= self.high_freq_factor:
            raise ValueError(f"ModelConfig.rope.low_freq_factor={self.low_freq_factor} must be > 0 and at most "
                             f"rope.high_freq_factor={self.high_freq_factor}")
        if self.scaling == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(f"ModelConfig.rope.beta_slow={self.beta_slow} must be > 0 and <= "
                             f"rope.beta_fast={self.beta_fast}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"ModelConfig.rope.attention_factor must be > 0, got {self.attention_factor}")
        if self.dim is not None and (self.dim < 1 or self.dim % 2):
            raise ValueError(f"ModelConfig.rope.dim={self.dim} must be even and >= 2 (or None: the whole head)")

    FIELD = "rope"


@dataclasses.dataclass(frozen=True)
class MlaConfig(_FieldGroup):
    """Multi-head latent attention (DeepSeek-V2/V3; ModelConfig.mla): every head's key and value
    are projected up from one latent of kv_rank per token, which (with the RoPE key of rope_dim,
    shared by the heads) is all a decode cache holds. A query/key head of head_dim is a rope_dim
    part rotated by RoPE followed by head_dim - rope_dim without positions; values have value_dim.

    q_rank: queries through a latent of this rank too (None: one full-rank projection).
    value_dim: None = head_dim.
    softmax_scale_factor: multiplies the logits' head_dim**-0.5 (DeepSeek's YaRN mscale squared).
    latent_norm_eps: the latents' RMSNorms' eps (None = ModelConfig.norm_eps; HF builds them with 1e-6).
    """

    kv_rank: int = 512  # the latent each token's keys and values come from (what a decode cache holds)
    rope_dim: int = 64  # dims of each query/key head rotated by RoPE (the key's part shared by the heads)
    q_rank: Optional[int] = None
    value_dim: Optional[int] = None
    softmax_scale_factor: float = 1.0
    latent_norm_eps: Optional[float] = None

    FIELD = "mla"

    def __post_init__(self):
        for name in ("kv_rank", "rope_dim", "q_rank", "value_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ModelConfig.mla.{name} must be >= 1, got {value}")
        if self.rope_dim % 2:
            raise ValueError(f"ModelConfig.mla.rope_dim must be even, got {self.rope_dim}")
        if self.softmax_scale_factor <= 0:
            raise ValueError(f"ModelConfig.mla.softmax_scale_factor must be > 0, got {self.softmax_scale_factor}")
        if self.latent_norm_eps is not None and self.latent_norm_eps <= 0:
            raise ValueError(f"ModelConfig.mla.latent_norm_eps must be > 0, got {self.latent_norm_eps}")


@dataclasses.dataclass(frozen=True)
class IndexerConfig(_FieldGroup):
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2; ModelConfig.indexer, with mla): each query
    attends only to the top_k keys of highest index score I[t, s] = sum_h w[t, h] relu(q_h[t] . k[s] /
    sqrt(head_dim)), over `heads` index heads of head_dim (queries from mla's query latent, one key per token
    through a LayerNorm of norm_eps; the first mla.rope_dim dims of each rotated by RoPE, halves rotated
    together) and per-head weights w = a projection of x / sqrt(heads). The indexer's input is detached: it learns
    from its own KL loss (Task.indexer_loss_weight). attention_impl="chunked" gathers each query's chosen keys
    (tfm.ops.topk_attention); otherwise, and when decoding, dense attention masked to them."""

    heads: int = 64  # index heads
    head_dim: int = 128  # width of an index head
    top_k: int = 2048  # keys each query attends to
    norm_eps: float = 1e-6  # the index keys' LayerNorm

    FIELD = "indexer"

    def __post_init__(self):
        _positive(self, "heads", "head_dim", "top_k", "norm_eps")


MIXER_GROUPS = {}  # mixer_pattern kind -> the ModelConfig group that configures it (filled by `mixer_group`)
_KINDS = {"mixer": ["attention"], "ffn": []}  # the kinds registered so far, in order


def register_kind(kind: str, ffn: bool = False) -> None:
    """Makes `kind` a valid mixer_pattern (ffn=True: ffn_pattern) entry; tfm.layers.slot calls it for every
    module it registers, `mixer_group` for every kind it configures."""
    kinds = _KINDS["ffn" if ffn else "mixer"]
    if kind not in kinds:
        kinds.append(kind)


def mixer_group(*kinds: str):
    """Class decorator: the group configures the mixer_pattern (or ffn_pattern) `kinds`; ModelConfig gets
    a field named its FIELD holding it (an instance, a dict of its fields, or None for its defaults)."""
    def register(group):
        for kind in kinds:
            MIXER_GROUPS[kind] = group
            register_kind(kind)
        return group
    return register


def entry_kinds(entry: str) -> list:
    """The kinds a mixer_pattern entry names: "a", composite "a+b", fed "f>a" (or "f>a+b")."""
    return [k for part in entry.split(">") for k in part.split("+")]


def mixer_groups() -> tuple:
    """The registered mixer groups, each once."""
    return tuple(dict.fromkeys(MIXER_GROUPS.values()))


def mixer_kinds() -> tuple:
    """ModelConfig.mixer_pattern's kinds: attention, every kind a group configures or a module registered
    (tfm.layers.slot), and "none"."""
    return tuple(_KINDS["mixer"]) + ("none",)


def ffn_kinds() -> tuple:
    """ModelConfig.ffn_pattern's kinds: FFN_KINDS and the registered feed-forwards (tfm.layers.slot)."""
    return FFN_KINDS[:2] + tuple(k for k in _KINDS["ffn"] if k not in FFN_KINDS) + FFN_KINDS[2:]


@mixer_group("mamba")
@dataclasses.dataclass(frozen=True)
class MambaConfig(_FieldGroup):
    """Mamba's selective state-space mixer (ModelConfig.mamba, layers "mamba"; Gu & Dao 2023): x [B, T, D]
    projected to E = expand * D channels and a gate, a causal depthwise convolution of conv_kernel taps,
    input-dependent step sizes (through rank dt_rank), B and C of state_size, a diagonal state [E, state_size]
    per sequence, a D skip, and the gated output projected back to D."""

    state_size: int = 16  # the state per channel
    conv_kernel: int = 4  # taps of the causal depthwise convolution
    expand: int = 2  # inner channels E = expand * D
    dt_rank: Optional[int] = None  # None = ceil(D / 16)
    conv_bias: bool = True  # a bias on the convolution
    proj_bias: bool = False  # biases on the input and output projections
    inner_norms: bool = False  # config.norm over dt (before its up-projection), B and C (Jamba)
    inner_norm_weights: bool = True  # False: the inner norms are RMSNorms without a scale (FalconMamba)
    inner_norm_eps: Optional[float] = None  # the inner norms' epsilon; None = ModelConfig.norm_eps

    FIELD = "mamba"

    def __post_init__(self):
        _positive(self, "state_size", "conv_kernel", "expand", "dt_rank")


@mixer_group("mamba2")
@dataclasses.dataclass(frozen=True)
class Mamba2Config(_FieldGroup):
    """Mamba-2's SSD mixer (ModelConfig.mamba2, layers "mamba2"; Dao & Gu 2024): E = expand * D channels in
    heads of head_dim, each head one scalar decay per step; B and C of state_size shared by the heads of
    each of `groups`; a causal depthwise convolution over x, B and C; a D skip; a gated RMSNorm (in
    norm_groups groups of channels) before the output projection. The step size is softplus(dt + dt_bias)
    clamped to dt_limit."""

    state_size: int = 128  # the width of B and C: the state per head channel
    conv_kernel: int = 4  # taps of the causal depthwise convolution over x, B and C
    expand: int = 2  # inner channels E = expand * D
    head_dim: int = 64  # channels per head (E / head_dim heads)
    groups: int = 1  # B and C groups, each shared by its heads
    norm_groups: Optional[int] = None  # None = groups
    conv_bias: bool = True  # a bias on the convolution
    proj_bias: bool = False  # biases on the input and output projections
    dt_limit: Tuple[float, float] = (0.0, float("inf"))  # the step size clamped to (low, high)
    inner: Optional[int] = None  # inner channels E, a multiple of head_dim; None = expand * D (Falcon-H1's mamba_d_ssm)
    # the gate z with the output y: "gate_first" RMSNorm(y * silu(z)) (Mamba-2), "norm_first" RMSNorm(y) * silu(z),
    # "none" y * silu(z) without a norm (Falcon-H1's mamba_rms_norm=False)
    gate_norm: str = "gate_first"
    # the input projections' outputs (gate, x, B, C, dt) times these (Falcon-H1's µP ssm_multipliers)
    proj_multipliers: Tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    FIELD = "mamba2"
    PROJECTIONS = ("gate", "x", "B", "C", "dt")  # proj_multipliers' order
    GATE_NORMS = ("gate_first", "norm_first", "none")

    def __post_init__(self):
        _positive(self, "state_size", "conv_kernel", "expand", "head_dim", "groups", "norm_groups", "inner")
        object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
        if len(self.dt_limit) != 2 or not 0 <= self.dt_limit[0] < self.dt_limit[1]:
            raise ValueError(f"ModelConfig.mamba2.dt_limit={self.dt_limit} must be (low, high) with 0 <= low < high")
        if self.inner is not None and self.inner % self.head_dim:
            raise ValueError(f"ModelConfig.mamba2.inner={self.inner} must be a multiple of head_dim={self.head_dim}")
        if self.gate_norm not in self.GATE_NORMS:
            raise ValueError(f"ModelConfig.mamba2.gate_norm={self.gate_norm!r} must be one of {self.GATE_NORMS}")
        object.__setattr__(self, "proj_multipliers", tuple(float(v) for v in self.proj_multipliers))
        if len(self.proj_multipliers) != 5 or not all(v > 0 for v in self.proj_multipliers):
            raise ValueError(f"ModelConfig.mamba2.proj_multipliers={self.proj_multipliers} must be 5 values > 0, "
                             f"one per input projection {self.PROJECTIONS}")

    def width(self, d_model: int) -> int:
        """The inner channels E: `inner`, or expand * d_model."""
        return self.inner or self.expand * d_model


@mixer_group("gated_deltanet")
@dataclasses.dataclass(frozen=True)
class DeltaNetConfig(_FieldGroup):
    """Gated DeltaNet (ModelConfig.deltanet, layers "gated_deltanet"; Yang et al. 2024, Qwen3-Next's linear
    attention): key_heads query/key heads of key_head_dim (L2-normalised), value_heads value heads of
    value_head_dim (a multiple of key_heads; each key head serves value_heads / key_heads of them), a causal
    depthwise convolution of conv_kernel taps over q, k and v, per-head gates beta (write strength) and
    alpha (decay), and a gated RMSNorm per value head before the output projection."""

    key_heads: int = 16  # query/key heads
    value_heads: int = 32  # value heads, a multiple of key_heads
    key_head_dim: int = 128  # width of a query/key head
    value_head_dim: int = 128  # width of a value head
    conv_kernel: int = 4  # taps of the causal depthwise convolution over q, k and v

    FIELD = "deltanet"

    def __post_init__(self):
        _positive(self, "key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel")
        if self.value_heads % self.key_heads:
            raise ValueError(f"ModelConfig.deltanet.value_heads={self.value_heads} must be a multiple of "
                             f"key_heads={self.key_heads}")


@mixer_group("kda")
@dataclasses.dataclass(frozen=True)
class KdaConfig(_FieldGroup):
    """Kimi Delta Attention (ModelConfig.kda, layers "kda"; Kimi Linear 2025): the gated delta rule with a decay
    per key channel. q, k and v in `heads` heads of head_dim, each through a causal depthwise convolution of
    conv_kernel taps and SiLU, q and k L2-normalised; beta = sigmoid of a projection; the log decay
    -exp(A_log) softplus(f + dt_bias) per channel and the sigmoid output gate each from a rank-head_dim
    projection of x; an RMSNorm per head times the gate before the output projection."""

    heads: int = 32  # heads of q, k and v
    head_dim: int = 128  # width of each head (key and value alike)
    conv_kernel: int = 4  # taps of the causal depthwise convolution over q, k and v

    FIELD = "kda"

    def __post_init__(self):
        _positive(self, "heads", "head_dim", "conv_kernel")


@mixer_group("mlstm")
@dataclasses.dataclass(frozen=True)
class MLstmConfig(_FieldGroup):
    """The mLSTM (ModelConfig.mlstm, layers "mlstm"; xLSTM, Beck et al. 2024, xLSTM-7B's block): `heads` heads of
    a matrix memory with exponential input and sigmoid forget gates (per head, soft-capped), stabilised by a
    running maximum; q and k of qk_dim in all, v of v_dim; each head's output layer-normalised, times a sigmoid
    output gate (per channel), projected back."""

    heads: int = 8  # heads of the memory
    qk_dim: Optional[int] = None  # query/key width over all heads; None = d_model / 2
    v_dim: Optional[int] = None  # value width over all heads; None = d_model
    gate_soft_cap: Optional[float] = 15.0  # the gates' preactivations through cap * tanh(x / cap); None = none
    eps: float = 1e-6  # added to the output's normaliser

    FIELD = "mlstm"

    def __post_init__(self):
        _positive(self, "heads", "qk_dim", "v_dim", "gate_soft_cap", "eps")
        for name in ("qk_dim", "v_dim"):
            if getattr(self, name) is not None and getattr(self, name) % self.heads:
                raise ValueError(f"ModelConfig.mlstm.{name}={getattr(self, name)} must be a multiple of "
                                 f"heads={self.heads}")

    def widths(self, d_model: int) -> tuple:
        """(qk_dim, v_dim) with their defaults for a model of width d_model."""
        return self.qk_dim or d_model // 2, self.v_dim or d_model


@mixer_group("rwkv")
@dataclasses.dataclass(frozen=True)
class RwkvConfig(_FieldGroup):
    """RWKV (ModelConfig.rwkv; layers "rwkv" and ffn "rwkv", RWKV-4 as transformers' RwkvModel): the time mix
    (token shift, receptance-gated WKV of attention_width channels) and the channel mix (token shift,
    receptance-gated squared-ReLU feed-forward of ModelConfig.d_ff)."""

    attention_width: Optional[int] = None  # None = d_model

    FIELD = "rwkv"

    def __post_init__(self):
        _positive(self, "attention_width")


@mixer_group("rglru")
@dataclasses.dataclass(frozen=True)
class RgLruConfig(_FieldGroup):
    """Griffin's recurrent block (ModelConfig.rglru, layers "rglru"; De et al. 2024, RecurrentGemma): two
    branches of `width` channels, one GeLU-gated, the other through a causal depthwise convolution of
    conv_kernel taps and the RG-LRU (input and recurrence gates block-diagonal over ModelConfig.num_heads,
    decay a = sigmoid(Lambda)^(c * r_t))."""

    width: Optional[int] = None  # None = d_model
    conv_kernel: int = 4  # taps of the causal depthwise convolution
    c: float = 8.0  # the decay's exponent scale: a = sigmoid(Lambda)^(c * r_t)

    FIELD = "rglru"

    def __post_init__(self):
        _positive(self, "width", "conv_kernel", "c")


@mixer_group("short_conv")
@dataclasses.dataclass(frozen=True)
class ShortConvConfig(_FieldGroup):
    """LFM2's gated short convolution (ModelConfig.short_conv, layers "short_conv"; Liquid AI 2025): from x
    [B, T, D] three projections b, c, h; the causal depthwise convolution of `kernel` taps over b * h, times c,
    projected back to D."""

    kernel: int = 3  # taps of the causal depthwise convolution (HF's conv_L_cache)
    bias: bool = False  # biases on the projections and the convolution

    FIELD = "short_conv"

    def __post_init__(self):
        _positive(self, "kernel")


@mixer_group("lightning")
@dataclasses.dataclass(frozen=True)
class LightningConfig(_FieldGroup):
    """Lightning attention (ModelConfig.lightning, layers "lightning"; MiniMax-01 2025): linear attention with a
    fixed decay per head, in ModelConfig.num_heads heads of head_dim: q, k, v = silu of projections of x,
    state S_t = exp(-slope) S_{t-1} + k_t^T v_t, o_t = q_t S_t; an RMSNorm over all heads, a sigmoid output gate
    and the output projection. The slopes are ALiBi's, scaled by 1 - layer / (num_layers - 1)."""

    output_norm_eps: float = 1e-6  # the RMSNorm over the heads' outputs (MiniMax fixes it, apart from norm_eps)

    FIELD = "lightning"


@mixer_group("shared")
@dataclasses.dataclass(frozen=True)
class SharedBlockConfig(_FieldGroup):
    """Zamba's shared transformer (ModelConfig.shared_block, the feeder of mixer_pattern entries "shared>k"; Glorioso
    et al. 2024): `blocks` sets of parameters, each an attention (input norm, num_heads of head_dim, out to D) then
    a feed-forward (its own norm, d_ff wide; no residual inside), cycled over the layers that use one in layer
    order. A use reads concat[x, the stack's input embeddings] (width 2D; x alone without `embeddings`), adds per-use
    LoRA adapters of lora_rank to the projections named in `lora` (merged into the shared weight for that use),
    and projects the block's output through its own [D, D] linear into the layer's mixer input."""

    blocks: int = 1  # distinct parameter sets (Zamba2's num_mem_blocks), used in turn
    embeddings: bool = True  # the block reads concat[x, embeddings] [B, T, 2D]; False: x [B, T, D]
    d_ff: Optional[int] = None  # the block's feed-forward width; None = ModelConfig.d_ff
    lora_rank: int = 0  # per-use adapters' rank; 0 = none
    lora: Tuple[str, ...] = ("query", "key", "value", "ffn")  # the projections a use adapts (ffn: the gate and up)

    FIELD = "shared_block"
    LORA = ("query", "key", "value", "ffn")

    def __post_init__(self):
        _positive(self, "blocks", "d_ff")
        object.__setattr__(self, "lora", tuple(self.lora))
        if self.lora_rank < 0 or set(self.lora) - set(self.LORA):
            raise ValueError(f"ModelConfig.shared_block: lora_rank={self.lora_rank} must be >= 0 and lora={self.lora} "
                             f"a subset of {self.LORA}")


def _positive(group, *names):
    """Raises unless each named field of `group` is None or > 0."""
    for name in names:
        value = getattr(group, name)
        if value is not None and value <= 0:
            raise ValueError(f"ModelConfig.{group.FIELD}.{name} must be > 0, got {value}")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig(_FieldGroup):
    """How a run executes a model (ModelConfig.execution), never what it computes: the same
    parameters compute the same function under any ExecutionConfig (up to the compute dtype's
    rounding; scan_layers stacks each layer's arrays along a leading axis, and capacity_factor is
    the one setting that may drop tokens). Its fields are the one list of such settings: import
    overrides, export, the vision-language model and old flat records read them from here.

    dtype: the computation dtype (params are float32).
    scan_layers: the stack as one `nn.scan` over stacked layer params (compiles once per layer kind).
    remat_policy: what each block saves for the backward ("none", "full", or a jax.checkpoint policy).
    attention_impl: a backend of `tfm.capabilities.ATTENTION`, or "auto" (tfm.ops.select per call).
    attention_chunk_size: the chunked backend's key block (and context parallelism's chunked blocks).
    attention_block_sizes: the Pallas kernel tiles (and their Triton launch parameters on GPU): a
      BlockSizes, a dict of its fields, or (block_q, block_kv[, block_q_bwd, block_kv_bwd]); None =
      the kernel's per-backend default.
    context_strategy: the sequence split over the mesh's `context` axis: "ring" passes K/V blocks
      around the devices (O(L/c) memory each), "all_gather" gathers all of K/V (tfm.ops.context).
    moe_impl: "ragged" (sort by expert + grouped matmuls, dropless) or "einsum" (one-hot slots).
    capacity_factor: moe_impl="einsum" slots per expert, ceil(factor * T * k / E), tokens past them
      dropped; None = dropless (C = T).
    moe_chunks: moe_impl="ragged": each device dispatches its tokens in this many sequential chunks,
      each rematerialised, so the sort and all-to-all buffers ([n, N*k, D]) are 1/moe_chunks the
      size; must divide the tokens per device. Values and gradients do not change.
    logits_block_size: the logits matmul runs on the vocabulary rounded up to a multiple of this
      (zero rows, sliced off after), so GPU matmul kernels see whole tiles (GPT-2's 50,257 is not
      a multiple of 8); 1 = as is; None = 128 on GPU (measured: benchmarks/RESULTS.md), 1 elsewhere.
      The parameters and logits keep V.
    mixer_impl: how the linear-time token mixers run (tfm.capabilities.MIXER): "reference" (the
      recurrent form, a scan over time), "chunked" (the parallel form), "pallas" (the Pallas kernels),
      "auto" (chunked over a sequence, the recurrent step for a single token).
    mixer_chunk_size: tokens per chunk of the chunked form (of the kernels: their tile, rows per block on TPU).
    embedding_impl: how the token table is read under a mesh whose rules shard it (FSDP on D,
      `tensor` on V): "sharded" keeps it sharded (the ids gathered, the rows exchanged all-to-all,
      a sum over V's group; tfm.layers.embeddings.sharded_lookup), "xla" leaves the layout to XLA's
      partitioner (which may gather the whole table and sum its whole gradient), "auto" = "sharded"
      when the table has more rows than a device has tokens.
    """

    dtype: str = "float32"
    scan_layers: bool = False
    remat_policy: str = "none"
    attention_impl: str = "xla"
    attention_chunk_size: int = 128
    attention_block_sizes: Union[BlockSizes, dict, tuple, None] = None
    context_strategy: str = "ring"
    moe_impl: str = "ragged"
    capacity_factor: Optional[float] = None
    moe_chunks: int = 1
    logits_block_size: Optional[int] = None
    embedding_impl: str = "auto"
    mixer_impl: str = "auto"
    mixer_chunk_size: int = 64

    FIELD = "execution"
    CHOICES = dict(dtype=DTYPE_NAMES, remat_policy=REMAT_POLICY_NAMES, attention_impl=capabilities.ATTENTION_IMPLS,
                   context_strategy=capabilities.CONTEXT_STRATEGIES, moe_impl=tuple(capabilities.MOE),
                   embedding_impl=EMBEDDING_IMPLS, mixer_impl=capabilities.MIXER_IMPLS)

    def __post_init__(self):
        for name, allowed in self.CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.execution.{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.logits_block_size is not None and self.logits_block_size < 1:
            raise ValueError(f"ModelConfig.execution.logits_block_size must be >= 1 or None, got "
                             f"{self.logits_block_size}")
        if self.mixer_chunk_size < 1:
            raise ValueError(f"ModelConfig.execution.mixer_chunk_size must be >= 1, got {self.mixer_chunk_size}")
        if self.attention_chunk_size < 1:
            raise ValueError(f"ModelConfig.execution.attention_chunk_size must be >= 1, got {self.attention_chunk_size}")
        object.__setattr__(self, "attention_block_sizes", _block_sizes(self.attention_block_sizes))
        if self.attention_block_sizes is not None and not self.may_use("block_sizes"):
            raise ValueError(f"ModelConfig.execution.attention_block_sizes are the Pallas kernels' tiles; "
                             f"attention_impl={self.attention_impl!r} would ignore them")
        moe = capabilities.MOE[self.moe_impl]
        if self.moe_chunks < 1 or (self.moe_chunks > 1 and not moe.chunks):
            raise ValueError(f"ModelConfig.execution.moe_chunks={self.moe_chunks} must be >= 1, and > 1 needs "
                             f"{_having('chunks')} (moe_impl={self.moe_impl!r})")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"ModelConfig.execution.capacity_factor must be > 0, got {self.capacity_factor}")
        if self.capacity_factor is not None and not moe.capacity:
            raise ValueError(f"ModelConfig.execution.capacity_factor={self.capacity_factor} needs "
                             f"{_having('capacity')} (moe_impl={self.moe_impl!r} is dropless)")

    def may_use(self, *features: str) -> bool:
        """Whether attention_impl can compute every named feature: its backend's declaration, or for
        "auto" some backend's (auto picks one that can, per call)."""
        wanted = {name: True for name in features}
        if self.attention_impl == "auto":
            return bool(capabilities.supporting(**wanted))
        return not capabilities.ATTENTION[self.attention_impl].missing(**wanted)


def _having(feature: str) -> str:
    """"moe_impl='x' or moe_impl='y'": the MoE implementations declaring `feature`."""
    return " or ".join(f"moe_impl={n!r}" for n, s in capabilities.MOE.items() if getattr(s, feature))


@dataclasses.dataclass(frozen=True)
class MultimodalConfig:
    """Image-text settings (ModelConfig.multimodal) of Llama 3.2 Vision (Hugging Face's Mllama).

    A text decoder reads the first two: the decoder layers at `cross_attention_layers` attend to
    image features instead of to the text (no self-attention), with q/k RMSNorm and tanh gates
    (zero at init) on their attention and feed-forward outputs; the token table has
    `extra_tokens` rows past vocab_size (image tokens, embedded, never predicted).
    A tiled vision encoder reads the rest: images come as up to `max_num_tiles` tiles whose
    layout `aspect_ratio_id` (1..max_aspect_ratio_id; 0 = none) picks gated tile embeddings;
    `num_global_layers` gated layers follow the ModelConfig's num_layers local ones, and the
    outputs of the local layers at `intermediate_layers` join the final features.
    A vision-language model (tfm.models.vision_language) is the text decoder's ModelConfig with
    `vision`, the tiled encoder's ModelConfig (or a dict of its fields), whose features it projects
    to d_model for the cross-attention layers.
    """

    cross_attention_layers: Tuple[int, ...] = ()  # decoder layers attending to image features instead of the text
    extra_tokens: int = 0  # token-table rows past vocab_size (image tokens: embedded, never predicted)
    max_num_tiles: int = 0  # 0 = not a tiled vision encoder
    max_aspect_ratio_id: int = 0  # tile layouts: aspect_ratio_id 1..this picks gated tile embeddings
    num_global_layers: int = 0  # gated layers after the num_layers local ones (tiled vision encoder)
    intermediate_layers: Tuple[int, ...] = ()  # local layers whose outputs join the final features
    vision: Union["ModelConfig", dict, None] = None  # the tiled vision encoder's ModelConfig (or a dict of its fields)

    def __post_init__(self):
        if isinstance(self.vision, Mapping):
            object.__setattr__(self, "vision", ModelConfig.from_dict(self.vision))
        for name in ("cross_attention_layers", "intermediate_layers"):
            value = tuple(getattr(self, name))
            if len(set(value)) != len(value) or any(not isinstance(i, int) or i < 0 for i in value):
                raise ValueError(f"ModelConfig.multimodal.{name}={value!r} must be distinct layer indices >= 0")
            object.__setattr__(self, name, tuple(sorted(value)))
        for name in ("extra_tokens", "max_num_tiles", "max_aspect_ratio_id", "num_global_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelConfig.multimodal.{name} must be >= 0, got {getattr(self, name)}")
        tiled = (self.max_aspect_ratio_id, self.num_global_layers, self.intermediate_layers)
        if any(tiled) and not self.max_num_tiles:
            raise ValueError("ModelConfig.multimodal: max_aspect_ratio_id, num_global_layers and "
                             "intermediate_layers describe a tiled vision encoder; set max_num_tiles")
        if self.max_num_tiles and self.max_aspect_ratio_id < 1:
            raise ValueError("ModelConfig.multimodal.max_num_tiles needs max_aspect_ratio_id >= 1")

    @classmethod
    def coerce(cls, value) -> "MultimodalConfig":
        """A MultimodalConfig from itself, a mapping of its fields, or None (the defaults: text only)."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"ModelConfig.multimodal must be a MultimodalConfig or a dict of its fields, "
                             f"got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"ModelConfig.multimodal has no field(s) {unknown}; its fields are {names}")
        return cls(**value)


# ModelConfig's flat RoPE fields before `rope` grouped them (configs recorded then still load).
LEGACY_ROPE_FIELDS = {"rope_theta": "theta", "rope_scaling": "scaling", "rope_scaling_factor": "factor",
                      "rope_original_max_len": "original_max_len", "rope_low_freq_factor": "low_freq_factor",
                      "rope_high_freq_factor": "high_freq_factor", "rope_beta_fast": "beta_fast",
                      "rope_beta_slow": "beta_slow", "rope_truncate": "truncate",
                      "rope_attention_factor": "attention_factor", "rotary_dim": "dim",
                      "rope_interleaved": "interleaved"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of one transformer. Sizes use the shape letters of docs/DESIGN.md."""

    vocab_size: int  # V; an experiment takes it from its tokenizer (its own vocab_size setting), not model.overrides
    d_model: int  # D
    num_heads: int  # N
    num_layers: int  # encoder layers, or decoder layers for a decoder-only model
    d_ff: int  # F
    # Derived when left None, and always set once built (see `replace`):
    num_kv_heads: Optional[int] = None  # K; None = num_heads (MHA), 1 = MQA
    head_dim: Optional[int] = None  # H; None = d_model // num_heads
    num_decoder_layers: Optional[int] = None  # encoder-decoder only; None = num_layers
    max_len: int = 512  # longest sequence (learned positions: the table size)

    # Norms
    norm: str = "layernorm"  # the normalisation: LayerNorm or RMSNorm
    norm_eps: float = 1e-6  # added to the variance in every norm
    # one of NORM_POSITIONS: "post" for the original Transformer and BERT; "normed_residual" a pre-norm whose skip
    # path is the normed input, n(x) + f(n(x)) (MiniMax)
    norm_position: str = "pre"
    final_norm: bool = True  # a norm after the last block (pre-norm stacks)
    embedding_norm: bool = False  # BERT: LayerNorm on summed embeddings
    norm_bias: bool = True  # LayerNorm with a bias; False = scale only (MPT)
    # Norms multiply by (norm_scale_offset + scale): 1.0 for zero-centred scales (Gemma, Qwen3-Next, RecurrentGemma)
    norm_scale_offset: float = 0.0

    # Positions
    # How positions enter: a table added to the embeddings (sinusoidal, learned), queries and keys rotated
    # (rope, set by the rope group), a bias on the attention logits (alibi; relative: T5's buckets), or none.
    position: str = "sinusoidal"
    # position="rope": a RopeConfig, or a dict of its fields (over the defaults; over the current
    # rope in `replace`). rope.dim is set to head_dim when left None.
    rope: Union[RopeConfig, dict, None] = None
    # Per-layer position choice repeated over the stack (position="rope"): layer i rotates its queries and keys
    # when position_pattern[i % len] is "rope", and uses none when "none" (NoPE layers: SmolLM3, Cohere 2's global
    # layers, Llama 4). None = every layer rotates.
    position_pattern: Optional[Tuple[str, ...]] = None
    # The RoPE of "local" layers under attention_pattern (a RopeConfig or a dict of its fields over `rope`'s;
    # Gemma 3's local base 10k beside the global 1M). None = the local layers use `rope`.
    local_rope: Union[RopeConfig, dict, None] = None
    alibi_bias_max: float = 8.0  # ALiBi slopes 2^(-alibi_bias_max * i / N) (MPT's knob; 8 = the paper)
    position_offset: int = 0  # learned table row = position + offset (BART 2, RoBERTa pad_id + 1)
    padding_positions: bool = False  # RoBERTa: count non-pad tokens only; pad tokens sit at -1
    relative_buckets: int = 32  # position="relative" (T5): buckets of the per-head bias table
    relative_max_distance: int = 128  # distances beyond this share the last (log-spaced) bucket

    # Attention
    attention_bias: bool = True  # biases on q, k, v and output projections
    attention_out_bias: Optional[bool] = None  # bias on the output projection; None = attention_bias (Qwen2: False)
    attention_dropout: float = 0.0  # dropout on the attention probabilities
    scale_attention: bool = True  # logits q.k / sqrt(H); False = unscaled (T5)
    sliding_window: Optional[int] = None  # a query sees only keys fewer than this many positions away; None = all
    # Per-layer kinds repeated over the stack: layer i is attention_pattern[i % len]; "local" layers
    # see sliding_window keys, "global" ones all. None = every layer uses sliding_window (if set).
    # GPT-3 ("global", "local"), Gemma-2 ("local", "global"), Mistral ("local",).
    attention_pattern: Optional[Tuple[str, ...]] = None
    # "span" layers of attention_pattern attend causally within aligned spans of this many positions: a query at
    # position p sees keys at q <= p with q // span == p // span (Llama 4's chunked attention)
    attention_span: Optional[int] = None
    attn_logit_softcap: Optional[float] = None  # attention logits = cap * tanh(logits / cap) (Gemma 2); None = none
    # A learned logit per query head (`sinks` [N]) in every softmax's denominator, attending to nothing: a query
    # may give part of its weight to no key (gpt-oss). Backends declaring `sinks` (tfm.capabilities).
    attention_sinks: bool = False
    # Llama 4's attention temperature on layers without RoPE (position_pattern "none"): queries at position p times
    # 1 + nope_temperature * log(1 + floor((p + 1) / nope_temperature_floor)); 0 = none
    nope_temperature: float = 0.0
    nope_temperature_floor: int = 8192  # nope_temperature's position step: the temperature grows every this many
    # Llama 4: the rotated layers' queries and keys divided by their root mean square over each head after RoPE
    # (no weight; eps norm_eps)
    rope_qk_rms_norm: bool = False
    qk_norm: bool = False  # config.norm over each query and key head before RoPE (Qwen3; all heads: qk_norm_scope)
    # qk_norm's extent: "head" each head over its H dims (Qwen3, Gemma 3); "heads" all heads of a token together,
    # over N*H (queries) and K*H (keys) dims (OLMo 2)
    qk_norm_scope: str = "head"
    qk_norm_position: str = "before_rope"  # qk_norm before RoPE rotates (Qwen3, OLMo 2) or after it (HunYuan)
    # The attention logits' multiplier; None = head_dim**-0.5 (scale_attention) or 1. Gemma 2/3:
    # query_pre_attn_scalar**-0.5; Granite: attention_multiplier.
    attention_scale: Optional[float] = None
    # Each head's attention output times sigmoid of a `gate` projection [D, N, H] of the queries' input,
    # before the output projection (Qwen3-Next).
    attention_output_gate: bool = False
    key_multiplier: float = 1.0  # self-attention's projected keys times this (Falcon-H1's µP key_multiplier)
    # Multi-head latent attention (DeepSeek): an MlaConfig or a dict of its fields; None = plain projections.
    mla: Union[MlaConfig, dict, None] = None
    # DeepSeek Sparse Attention (with mla): an IndexerConfig or a dict of its fields; None = every visible key.
    indexer: Union[IndexerConfig, dict, None] = None
    value_rank: Optional[int] = None  # r: the value projection factorised W_V = W_V_down [D, r] W_V_up [r, K, H]
    # Linformer (encoders): keys and values projected along the length to this many rows (one learned
    # [max_len, P] matrix per layer, shared by keys and values); None = full attention.
    linformer_length: Optional[int] = None
    # Sparse self-attention on every layer (tfm.kernels.sparsity; not cross-attention): a pattern or a dict
    # {"kind": "strided" | "fixed" | "bigbird" | "longformer", **its fields}; backends declaring sparsity (tfm.capabilities).
    attention_sparsity: Union[sparsity_lib.Pattern, dict, None] = None
    # Longformer (HF LongformerModel): the rows of the global tokens attend to every key through their own
    # projections query_global, key_global, value_global; needs a Longformer attention_sparsity (its
    # globals may be 0: no global token, the projections unused).
    global_projections: bool = False

    # Token mixers: layer i's is mixer_pattern[i % len], a registered kind (tfm.layers.slot: "attention" = the
    # attention above; a linear-time mixer configured by its group below), "none" (no mixer) or "a+b" (a
    # parallel composite: both from one norm, outputs summed; Falcon-H1's "attention+mamba2"). None =
    # attention in every layer. Jamba: 7 "mamba" to 1 "attention"; Qwen3-Next: 3 "gated_deltanet" to 1.
    mixer_pattern: Optional[Tuple[str, ...]] = None
    # (kind, input multiplier, output multiplier) triples: that kind's mixer reads input * h and its output is
    # times output, in every layer it is in (Falcon-H1's per-branch µP multipliers); None = all 1
    mixer_multipliers: Optional[Tuple[Tuple[str, float, float], ...]] = None
    # (sublayer, multiplier) pairs: the skip path around that sublayer (a mixer kind, or "ffn") times this at the
    # residual add (MiniMax's alpha factors; its beta factors are mixer_multipliers' and ffn_multipliers' outputs);
    # None = all 1
    skip_multipliers: Optional[Tuple[Tuple[str, float], ...]] = None
    # Layer i's feed-forward: ffn_pattern[i % len] of FFN_KINDS. None = "moe" with num_experts (after the
    # dense_layers), else "dense". Jamba ("dense", "moe"); Nemotron-H's mixer-only layers "none".
    ffn_pattern: Optional[Tuple[str, ...]] = None
    # The mixers' groups, one field per group decorated `mixer_group` (named its FIELD: mamba, mamba2,
    # deltanet, ...), each a dataclass or a dict of its fields; None = its defaults.
    __annotations__.update({g.FIELD: f"Union[{g.__name__}, dict, None]" for g in mixer_groups()})
    vars().update({g.FIELD: None for g in mixer_groups()})

    # Feed-forward
    activation: str = "relu"  # the feed-forward's; swiglu, geglu and swiglu_clamped are gated (two input projections)
    # activation="swiglu_clamped" (gpt-oss): the gate clamped to at most swiglu_limit, the up projection to
    # [-swiglu_limit, swiglu_limit], then gate * sigmoid(swiglu_alpha * gate) * (up + 1)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702  # swiglu_clamped's gate sharpness: gate * sigmoid(swiglu_alpha * gate)
    ffn_bias: bool = True  # biases on the feed-forward projections
    # (gate, output) multipliers: the dense feed-forward's gate projection (wi_gate; wi when not gated) times gate
    # before the activation (Falcon-H1's µP mlp_multipliers), every feed-forward's output times output (also
    # MiniMax's mlp beta factor)
    ffn_multipliers: Tuple[float, float] = (1.0, 1.0)
    num_experts: int = 0  # E; 0 = dense feed-forward
    experts_per_token: int = 2  # top-k routing
    router_aux_loss_coef: float = 0.01  # weight of each MoE layer's load-balancing loss (Switch, Mixtral)
    # DeepSeek-V3's sequence-wise balance loss (eq. 17-20): alpha * sum_e f_e P_e per sequence (batch row), averaged
    router_seq_aux_loss_coef: float = 0.0
    router_norm_topk: bool = True  # k > 1: renormalise the top-k gates to sum to 1; False = softmax probs (Qwen2-MoE)
    shared_expert_d_ff: int = 0  # width of an always-on expert added under a per-token sigmoid gate (Qwen2-MoE)
    shared_expert_gate: bool = True  # False: the shared expert is added ungated (DeepSeek-V3)
    router_score: str = "softmax"  # expert scores: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3)
    router_logit_bias: bool = False  # a learned bias on the router's logits, trained as any weight (gpt-oss)
    router_gate_input: bool = False  # experts_per_token=1: the gate scales the expert's input, not its output (Llama 4)
    # DeepSeek-V3's group-limited routing: the experts in router_groups equal groups, a token choosing
    # among the router_group_top groups whose two best scores sum highest; 1 = no groups.
    router_groups: int = 1
    router_group_top: int = 1  # router_groups > 1: how many groups a token chooses among
    router_bias: bool = False  # a per-expert `score_bias` added to the scores for the choice only (no gradient)
    router_bias_rate: float = 0.001  # its update per step: -rate * sign(expert load - mean load) (DeepSeek-V3's gamma)
    router_scale: float = 1.0  # multiplies the gates (DeepSeek's routed_scaling_factor)
    dense_layers: int = 0  # MoE models: the first this many layers have a dense feed-forward of dense_d_ff
    dense_d_ff: Optional[int] = None  # None = d_ff

    # Block
    residual_multiplier: float = 1.0  # each sublayer's output times this before the residual add (Granite)
    parallel_block: bool = False  # GPT-J / PaLM: x + attn(norm(x)) + ffn(norm(x))
    parallel_norms: int = 1  # parallel_block: 1 shared norm (GPT-J), 2 = x + attn(n1 x) + ffn(n2 x) (GPT-NeoX)
    dropout_rate: float = 0.0  # residual and embedding dropout

    # Embeddings and output
    type_vocab_size: int = 0  # BERT token types; 0 = none
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(D)
    embedding_multiplier: float = 1.0  # token embeddings times this (Granite's µP multiplier)
    # scale_embeddings' sqrt(D) rounded to this float type first (RecurrentGemma's bfloat16 constant); None = exact
    embedding_scale_rounding: Optional[str] = None
    tie_embeddings: bool = True  # output projection = token embedding transposed
    share_source_target_embeddings: bool = True  # encoder-decoder: one matrix for both sides
    output_bias: bool = False  # bias on output logits (BERT MLM, Marian final_logits_bias)
    # logits times this (the final hidden states scaled before the output projection): Cohere's logit_scale,
    # Granite's 1 / logits_scaling
    logits_multiplier: float = 1.0
    final_logit_softcap: Optional[float] = None  # logits = cap * tanh(logits / cap) (RecurrentGemma, Gemma 2)
    rescale_tied_output: bool = False  # T5 v1.0: hidden * D**-0.5 before the tied output projection
    pad_id: int = 0  # the padding token

    # Encoder heads (BERT family)
    heads: Tuple[str, ...] = ()
    num_labels: int = 2  # classification classes (regression: one score, span: start and end)
    head_activation: Optional[str] = None  # MLM transform activation; None = activation

    # Images (ViT, tfm.models.vision): [B, image_size, image_size, num_channels] in square patches
    image_size: int = 0  # 0 = a text model
    patch_size: int = 16  # ViT: square patches of this many pixels a side
    num_channels: int = 3  # ViT: channels of an image
    # Llama 3.2 Vision: cross-attention layers of a decoder, tiles of a vision encoder (a dict of
    # MultimodalConfig's fields is accepted); the default is none of either.
    multimodal: Union[MultimodalConfig, dict, None] = None

    # How a run executes the model (dtype, scan, remat, backends): an ExecutionConfig or a dict of its
    # fields (over the defaults; over the current execution in `replace`).
    execution: Union[ExecutionConfig, dict, None] = None

    # The fields that take one of a few values (checked in __post_init__; docs/CONFIG.md lists them), and
    # the tuple fields each of whose entries does.
    CHOICES = dict(norm=NORMS, norm_position=NORM_POSITIONS, position=POSITIONS, activation=ACTIVATION_NAMES,
                   router_score=ROUTER_SCORES, head_activation=(None,) + ACTIVATION_NAMES, qk_norm_scope=QK_NORM_SCOPES,
                   qk_norm_position=QK_NORM_POSITIONS)
    ENTRY_CHOICES = dict(attention_pattern=ATTENTION_KINDS, mixer_pattern=mixer_kinds, ffn_pattern=ffn_kinds, heads=HEADS,
                         position_pattern=LAYER_POSITIONS)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "execution", ExecutionConfig.coerce(self.execution))
        for name, allowed in self.CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not one of {allowed}")
        for name in ("num_kv_heads", "head_dim", "num_decoder_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} does not divide "
                             f"d_model={self.d_model}; set head_dim explicitly or change num_heads")
        self._derive(num_kv_heads=self.num_heads, head_dim=self.d_model // self.num_heads,
                     num_decoder_layers=self.num_layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        object.__setattr__(self, "rope", RopeConfig.coerce(self.rope))
        if self.position == "rope":
            if self.head_dim % 2:
                raise ValueError(f"ModelConfig.position='rope' needs an even head_dim, got {self.head_dim}")
            if self.rope.dim is None:
                object.__setattr__(self, "rope", dataclasses.replace(self.rope, dim=self.head_dim))
            if self.rope.dim > self.head_dim:
                raise ValueError(f"ModelConfig.rope.dim={self.rope.dim} must be at most head_dim={self.head_dim}")
        self._check_mla()
        self._check_layer_positions()
        for name in ("value_rank", "linformer_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.linformer_length is not None and (self.sliding_window is not None or
                                                  self.position in ("alibi", "relative")):
            raise ValueError("ModelConfig.linformer_length: projected keys have no positions, so a sliding_window, "
                             "ALiBi or a relative position bias cannot apply to them")
        if self.value_rank is not None and self.mla is not None:
            raise ValueError("ModelConfig.value_rank factorises the value projection, which mla replaces; set one")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"ModelConfig.position='sinusoidal' needs an even d_model, got {self.d_model}")
        self._check_pattern()
        self._check_mixers()
        if self.parallel_norms not in (1, 2):
            raise ValueError(f"ModelConfig.parallel_norms must be 1 or 2, got {self.parallel_norms}")
        if self.parallel_block and self.norm_position not in ("pre", "post"):
            raise ValueError(f"ModelConfig.norm_position={self.norm_position!r} is a sequential block's; "
                             f"parallel_block=True takes 'pre'")
        if self.parallel_norms == 2 and not self.parallel_block:
            raise ValueError("ModelConfig.parallel_norms=2 needs parallel_block=True")
        if self.alibi_bias_max <= 0:
            raise ValueError(f"ModelConfig.alibi_bias_max must be > 0, got {self.alibi_bias_max}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")
        if self.final_logit_softcap is not None and self.final_logit_softcap <= 0:
            raise ValueError(f"ModelConfig.final_logit_softcap must be > 0 or None, got {self.final_logit_softcap}")
        rounding = self.embedding_scale_rounding
        if rounding is not None and (rounding not in DTYPE_NAMES or not self.scale_embeddings):
            raise ValueError(f"ModelConfig.embedding_scale_rounding={rounding!r} must be one of {DTYPE_NAMES} "
                             f"with scale_embeddings=True, or None")
        for name in ("attention_dropout", "dropout_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        self._check_sparsity()
        self._check_attention_features()
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"ModelConfig.experts_per_token={self.experts_per_token} must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.shared_expert_d_ff < 0:
                raise ValueError(f"ModelConfig.shared_expert_d_ff must be >= 0, got {self.shared_expert_d_ff}")
        self._check_routing()
        if self.router_seq_aux_loss_coef < 0 or (self.router_seq_aux_loss_coef and not self.num_experts):
            raise ValueError(f"ModelConfig.router_seq_aux_loss_coef={self.router_seq_aux_loss_coef} must be >= 0 "
                             f"and needs num_experts > 0")
        if self.shared_expert_d_ff and not self.num_experts:
            raise ValueError(f"ModelConfig.shared_expert_d_ff={self.shared_expert_d_ff} needs num_experts > 0")
        unknown_heads = set(self.heads) - set(HEADS)
        if unknown_heads:
            raise ValueError(f"ModelConfig.heads has unknown {sorted(unknown_heads)}; choose from {HEADS}")
        if self.position_offset < 0 or (self.position_offset and self.position != "learned"):
            raise ValueError(f"ModelConfig.position_offset={self.position_offset} needs position='learned' "
                             f"and must be >= 0")
        if self.padding_positions and self.position != "learned":
            raise ValueError("ModelConfig.padding_positions needs position='learned'")
        if self.position == "learned" and self.max_len <= self.position_offset:
            raise ValueError(f"ModelConfig.max_len={self.max_len} (the learned table size) leaves no row after "
                             f"position_offset={self.position_offset}")
        for name in ("relative_buckets", "relative_max_distance"):
            if getattr(self, name) < 2:
                raise ValueError(f"ModelConfig.{name} must be >= 2, got {getattr(self, name)}")
        if self.rescale_tied_output and not self.tie_embeddings:
            raise ValueError("ModelConfig.rescale_tied_output scales the tied output projection; it needs "
                             "tie_embeddings=True")
        if self.image_size:
            if self.image_size < 0 or self.patch_size < 1 or self.image_size % self.patch_size:
                raise ValueError(f"ModelConfig.patch_size={self.patch_size} must divide image_size={self.image_size}")
            if self.num_channels < 1:
                raise ValueError(f"ModelConfig.num_channels must be >= 1, got {self.num_channels}")
        self._check_multimodal()
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"ModelConfig.pad_id={self.pad_id} outside the vocabulary [0, {self.vocab_size})")

    def _check_routing(self):
        if not self.num_experts:
            if self.dense_layers:
                raise ValueError(f"ModelConfig.dense_layers={self.dense_layers} needs num_experts > 0 (every layer "
                                 f"is dense without experts)")
            return
        groups, top = self.router_groups, self.router_group_top
        if groups < 1 or self.num_experts % groups:
            raise ValueError(f"ModelConfig.router_groups={groups} must divide num_experts={self.num_experts}")
        if not 1 <= top <= groups:
            raise ValueError(f"ModelConfig.router_group_top={top} must be in [1, router_groups={groups}]")
        if groups > 1 and self.experts_per_token > top * (self.num_experts // groups):
            raise ValueError(f"ModelConfig.experts_per_token={self.experts_per_token} exceeds the "
                             f"{top * (self.num_experts // groups)} experts of router_group_top={top} groups")
        if groups > 1 and self.num_experts // groups < 2:
            raise ValueError("ModelConfig.router_groups: a group is ranked by its two best experts; give it >= 2")
        if self.router_scale <= 0 or self.router_bias_rate <= 0:
            raise ValueError(f"ModelConfig.router_scale={self.router_scale} and router_bias_rate="
                             f"{self.router_bias_rate} must be > 0")
        if not 0 <= self.dense_layers <= self.num_layers:
            raise ValueError(f"ModelConfig.dense_layers={self.dense_layers} must be in [0, num_layers={self.num_layers}]")
        if self.dense_d_ff is not None and self.dense_d_ff < 1:
            raise ValueError(f"ModelConfig.dense_d_ff must be >= 1 or None, got {self.dense_d_ff}")
        if self.execution.scan_layers and self.dense_layers % self.pattern_period:
            raise ValueError(f"ModelConfig.dense_layers={self.dense_layers} must be a multiple of the attention "
                             f"pattern's period {self.pattern_period} to scan the MoE layers after them")

    def _check_mla(self):
        mla = None if self.mla is None else MlaConfig.coerce(self.mla)
        if self.indexer is not None:
            indexer = IndexerConfig.coerce(self.indexer)
            if mla is None or mla.q_rank is None:
                raise ValueError("ModelConfig.indexer scores keys from mla's query latent: set mla with a q_rank")
            if indexer.head_dim <= mla.rope_dim:
                raise ValueError(f"ModelConfig.indexer.head_dim={indexer.head_dim} must exceed mla.rope_dim (the "
                                 "rotated part of an index head)")
            object.__setattr__(self, "indexer", indexer)
        if mla is None:
            return
        if self.position not in ("rope", "none"):
            raise ValueError(f"ModelConfig.mla needs position='rope' (its decoupled RoPE key) or 'none' (that part "
                             f"unrotated: Kimi Linear), got {self.position!r}")
        if mla.rope_dim >= self.head_dim:
            raise ValueError(f"ModelConfig.mla.rope_dim={mla.rope_dim} must be below head_dim={self.head_dim} "
                             f"(a head is the RoPE part and the part without positions)")
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"ModelConfig.mla projects a key and value per query head: num_kv_heads="
                             f"{self.num_kv_heads} must equal num_heads={self.num_heads}")
        if self.position == "rope" and self.rope.dim not in (mla.rope_dim, self.head_dim):
            raise ValueError(f"ModelConfig.rope.dim={self.rope.dim} disagrees with mla.rope_dim={mla.rope_dim}; "
                             f"set only mla.rope_dim")
        object.__setattr__(self, "rope", dataclasses.replace(self.rope, dim=mla.rope_dim))
        latent_eps = None if mla.latent_norm_eps == self.norm_eps else mla.latent_norm_eps  # None: norm_eps's
        object.__setattr__(self, "mla", dataclasses.replace(mla, value_dim=mla.value_dim or self.head_dim,
                                                            latent_norm_eps=latent_eps))

    def _derive(self, **defaults):
        """Sets each None field of `defaults` to its derived value."""
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def _check_layer_positions(self):
        """position_pattern and local_rope: per-layer RoPE choices, which need position="rope"."""
        pattern = self.position_pattern
        if pattern is not None:
            if isinstance(pattern, str) or not isinstance(pattern, (tuple, list)) or not pattern:
                raise ValueError(f"ModelConfig.position_pattern must be a non-empty tuple of {LAYER_POSITIONS}, "
                                 f"got {pattern!r}")
            object.__setattr__(self, "position_pattern", tuple(pattern))
            bad = sorted(set(pattern) - set(LAYER_POSITIONS))
            if bad:
                raise ValueError(f"ModelConfig.position_pattern has unknown kinds {bad}; choose from {LAYER_POSITIONS}")
            if self.num_layers % len(pattern):
                raise ValueError(f"ModelConfig.position_pattern of length {len(pattern)} does not divide "
                                 f"num_layers={self.num_layers}")
        if self.local_rope is not None:
            local = RopeConfig.coerce(self.local_rope, self.rope)
            if local.dim is None:
                local = dataclasses.replace(local, dim=self.rope.dim)
            object.__setattr__(self, "local_rope", local)
        for name in ("position_pattern", "local_rope"):
            if getattr(self, name) is not None and self.position != "rope":
                raise ValueError(f"ModelConfig.{name} chooses RoPE per layer; it needs position='rope', "
                                 f"got {self.position!r}")
        if self.local_rope is not None and self.local_rope.dim > self.head_dim:
            raise ValueError(f"ModelConfig.local_rope.dim={self.local_rope.dim} must be at most head_dim={self.head_dim}")
        for name in ("attention_scale", "residual_multiplier", "embedding_multiplier", "logits_multiplier",
                     "key_multiplier"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {value}")
        object.__setattr__(self, "ffn_multipliers", tuple(float(v) for v in self.ffn_multipliers))
        if len(self.ffn_multipliers) != 2 or not all(v > 0 for v in self.ffn_multipliers):
            raise ValueError(f"ModelConfig.ffn_multipliers={self.ffn_multipliers} must be (gate, output), both > 0")
        if self.ffn_multipliers[0] != 1.0 and self.num_experts:
            raise ValueError("ModelConfig.ffn_multipliers' gate scales the dense feed-forward's gate projection; the "
                             f"experts of num_experts={self.num_experts} do not read it")
        if self.key_multiplier != 1.0 and self.mla is not None:
            raise ValueError("ModelConfig.key_multiplier scales the key projection, which multi-head latent "
                             "attention (mla) does not have")
        if self.router_gate_input and self.experts_per_token != 1:
            raise ValueError(f"ModelConfig.router_gate_input scales each token's one expert input by its gate; "
                             f"experts_per_token={self.experts_per_token} must be 1")
        if self.nope_temperature < 0 or self.nope_temperature_floor < 1:
            raise ValueError(f"ModelConfig.nope_temperature={self.nope_temperature} must be >= 0 and "
                             f"nope_temperature_floor={self.nope_temperature_floor} >= 1")
        if self.qk_norm_position == "after_rope" and self.qk_norm_scope != "head":
            raise ValueError("ModelConfig.qk_norm_position='after_rope' normalises each rotated head: it needs "
                             "qk_norm_scope='head'")
        if self.attention_scale is not None and not self.scale_attention:
            raise ValueError("ModelConfig.attention_scale is the logits' multiplier; scale_attention=False says "
                             "there is none: set one of them")
        if self.logits_multiplier != 1.0 and self.output_bias:
            raise ValueError("ModelConfig.logits_multiplier scales the hidden states before the output projection, "
                             "which would not scale output_bias; set one of them")

    def layer_rope(self, layer: int) -> Optional[RopeConfig]:
        """Layer `layer`'s RoPE (None = the layer has no positions rotated): position_pattern, then local_rope
        for "local" layers of attention_pattern."""
        if self.position != "rope":
            return None
        if self.position_pattern is not None and self.position_pattern[layer % len(self.position_pattern)] == "none":
            return None
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope

    def _check_pattern(self):
        pattern = self.attention_pattern
        if self.attention_span is not None and self.attention_span < 1:
            raise ValueError(f"ModelConfig.attention_span must be >= 1, got {self.attention_span}")
        if pattern is None:
            if self.attention_span is not None:
                raise ValueError("ModelConfig.attention_span is the 'span' layers' of attention_pattern, which is None")
            return
        if isinstance(pattern, str) or not isinstance(pattern, (tuple, list)) or not pattern:
            raise ValueError(f"ModelConfig.attention_pattern must be a non-empty tuple of {ATTENTION_KINDS}, "
                             f"got {pattern!r}")
        object.__setattr__(self, "attention_pattern", tuple(pattern))
        bad = sorted(set(pattern) - set(ATTENTION_KINDS))
        if bad:
            raise ValueError(f"ModelConfig.attention_pattern has unknown kinds {bad}; choose from {ATTENTION_KINDS}")
        if "local" in pattern and self.sliding_window is None:
            raise ValueError("ModelConfig.attention_pattern has 'local' layers but sliding_window is None")
        if ("span" in pattern) != (self.attention_span is not None):
            raise ValueError(f"ModelConfig.attention_span={self.attention_span} is the 'span' layers' (attention_pattern="
                             f"{pattern}): set both or neither")
        for name in ("num_layers", "num_decoder_layers"):
            if getattr(self, name) % len(pattern):
                raise ValueError(f"ModelConfig.attention_pattern of length {len(pattern)} does not divide "
                                 f"{name}={getattr(self, name)}")

    def _check_mixers(self):
        """The layer patterns' kinds, periods and groups (mixer_kinds, ffn_kinds, MIXER_GROUPS)."""
        for group in mixer_groups():
            object.__setattr__(self, group.FIELD, group.coerce(getattr(self, group.FIELD)))
        for name, kinds in (("mixer_pattern", mixer_kinds()), ("ffn_pattern", ffn_kinds())):
            pattern = getattr(self, name)
            if pattern is None:
                continue
            if isinstance(pattern, str) or not isinstance(pattern, (tuple, list)) or not pattern:
                raise ValueError(f"ModelConfig.{name} must be a non-empty tuple of {kinds}, got {pattern!r}")
            object.__setattr__(self, name, tuple(pattern))
            parts = [p for entry in pattern for p in (entry_kinds(entry) if name == "mixer_pattern" else [entry])]
            bad = sorted(set(parts) - set(kinds))
            if bad:
                raise ValueError(f"ModelConfig.{name} has unknown kinds {bad}; choose from {kinds}"
                                 + (" (or 'a+b', a parallel composite, or 'f>a', a's input fed by f)"
                                    if name == "mixer_pattern" else ""))
            if self.num_layers % len(pattern):
                raise ValueError(f"ModelConfig.{name} of length {len(pattern)} does not divide "
                                 f"num_layers={self.num_layers}")
        for entry in set(self.mixer_pattern or ()):
            *feeds, main = entry.split(">")
            parts = main.split("+")
            if len(parts) > 1 and ("none" in parts or len(set(parts)) < len(parts)):
                raise ValueError(f"ModelConfig.mixer_pattern entry {entry!r}: a parallel composite joins distinct "
                                 f"mixers with '+' (not 'none')")
            if feeds and (len(feeds) > 1 or "+" in feeds[0] or "none" in feeds + parts):
                raise ValueError(f"ModelConfig.mixer_pattern entry {entry!r}: 'f>a' feeds one kind f into the "
                                 f"input of the layer's mixer a (or composite a+b)")
            if "shared" in parts:
                raise ValueError(f"ModelConfig.mixer_pattern entry {entry!r}: a shared block feeds a mixer's input "
                                 f"('shared>a'); it is not a mixer itself")
            if feeds and (self.norm_position != "pre" or self.parallel_block):
                raise ValueError(f"ModelConfig.mixer_pattern entry {entry!r} adds f's output to the mixer's input "
                                 f"before its norm: it needs norm_position='pre' and a sequential block")
        if "shared" in self.mixers_used:
            self._check_shared_uses()
        if "moe" in (self.ffn_pattern or ()) and not self.num_experts:
            raise ValueError("ModelConfig.ffn_pattern has 'moe' layers but num_experts=0")
        if self.num_experts and self.ffn_pattern is not None and "moe" not in self.ffn_pattern:
            raise ValueError(f"ModelConfig.num_experts={self.num_experts} but ffn_pattern={self.ffn_pattern} "
                             f"has no 'moe' layer")
        mixers = self.mixers_used
        if self.mixer_multipliers is not None:
            triples = tuple((str(k), float(a), float(b)) for k, a, b in self.mixer_multipliers)
            object.__setattr__(self, "mixer_multipliers", triples)
            unused = sorted({k for k, _, _ in triples} - mixers)
            if unused:
                raise ValueError(f"ModelConfig.mixer_multipliers names {unused}, which no layer of mixer_pattern="
                                 f"{self.mixer_pattern} has")
        if self.skip_multipliers is not None:
            pairs = tuple((str(k), float(a)) for k, a in self.skip_multipliers)
            object.__setattr__(self, "skip_multipliers", pairs)
            unused = sorted({k for k, _ in pairs} - mixers - {"ffn"})
            if unused or not all(a > 0 for _, a in pairs):
                raise ValueError(f"ModelConfig.skip_multipliers={pairs}: each names a mixer kind some layer has, or "
                                 f"'ffn', with a multiplier > 0 ({unused} unused)")
            if self.parallel_block:
                raise ValueError("ModelConfig.skip_multipliers scale each sublayer's own skip path; a parallel block "
                                 "has one: use residual_multiplier or a sequential block")
        if mixers - {"attention"} and self.multimodal is not None and (
                MultimodalConfig.coerce(self.multimodal).cross_attention_layers):
            raise ValueError("ModelConfig.mixer_pattern's linear-time mixers and multimodal cross-attention "
                             "layers cannot be combined")
        width = self.rglru.width or self.d_model
        if "rglru" in mixers and width % self.num_heads:
            raise ValueError(f"ModelConfig.rglru.width={width} must be a multiple of num_heads={self.num_heads} "
                             f"(the RG-LRU's gates are block-diagonal over the heads)")

    def layer_mixer(self, layer: int) -> str:
        """Layer `layer`'s mixer_pattern entry: a kind (mixer_kinds), "none", or a composite "a+b"."""
        pattern = self.mixer_pattern or ("attention",)
        return pattern[layer % len(pattern)]

    def layer_mixers(self, layer: int) -> tuple:
        """The kinds of layer `layer`'s mixers: one, several (a parallel composite), or none (not its feeder)."""
        main = self.layer_mixer(layer).split(">")[-1]
        return () if main == "none" else tuple(main.split("+"))

    def layer_feed(self, layer: int) -> Optional[str]:
        """The kind whose output layer `layer` adds to its mixer's input (entry "f>a": f), or None."""
        entry = self.layer_mixer(layer)
        return entry.split(">")[0] if ">" in entry else None

    def shared_use(self, layer: int) -> int:
        """How many layers before `layer` (in the stack, or in a scanned period) use a shared block: its use index."""
        return sum(self.layer_feed(j) == "shared" for j in range(layer))

    def _check_shared_uses(self):
        """A scan repeats a period's uses: their blocks must repeat with it (blocks dividing the uses per period)."""
        period, blocks = self.pattern_period, self.shared_block.blocks
        uses = self.shared_use(period)
        if self.num_layers > period and uses % blocks:
            raise ValueError(f"ModelConfig.shared_block.blocks={blocks} must divide the {uses} uses in each repeat of "
                             f"mixer_pattern (period {period}); give mixer_pattern one entry per layer instead")
        if self.dense_layers:
            raise ValueError("ModelConfig.shared_block: shared blocks and a MoE model's dense first layers "
                             "(dense_layers) cannot be combined")

    @property
    def mixers_used(self) -> set:
        """The mixer kinds some layer has (a composite's each, a feeder; not "none")."""
        return {k for entry in self.mixer_pattern or ("attention",) for k in entry_kinds(entry) if k != "none"}

    def mixer_scales(self, kind: str) -> Tuple[float, float]:
        """(input, output) multipliers of `kind`'s mixer under mixer_multipliers (1, 1 unless named)."""
        for name, a, b in self.mixer_multipliers or ():
            if name == kind:
                return a, b
        return 1.0, 1.0

    def skip_scale(self, sublayer: str) -> float:
        """The skip path's multiplier around `sublayer` (a mixer kind or "ffn") under skip_multipliers."""
        return dict(self.skip_multipliers or ()).get(sublayer, 1.0)

    def layer_ffn(self, layer: int, dense: bool = False) -> str:
        """Layer `layer`'s feed-forward under ffn_pattern (FFN_KINDS); dense=True: one of a MoE model's
        first dense_layers layers."""
        if self.ffn_pattern is not None:
            kind = self.ffn_pattern[layer % len(self.ffn_pattern)]
            return "dense" if dense and kind == "moe" else kind
        return "moe" if self.num_experts and not dense else "dense"

    def _check_multimodal(self):
        mm = MultimodalConfig.coerce(self.multimodal)
        object.__setattr__(self, "multimodal", mm)
        for name in ("cross_attention_layers", "intermediate_layers"):
            layers = getattr(mm, name)
            if layers and layers[-1] >= self.num_layers:
                raise ValueError(f"ModelConfig.multimodal.{name}={layers} must lie in "
                                 f"[0, num_layers={self.num_layers})")
        if mm.cross_attention_layers and (self.execution.scan_layers or self.parallel_block or
                                          self.norm_position != "pre"):
            raise ValueError("ModelConfig.multimodal.cross_attention_layers need a looped (execution.scan_layers=False), "
                             "sequential (parallel_block=False), pre-norm stack")
        if mm.vision is not None and not (mm.vision.multimodal.max_num_tiles and mm.cross_attention_layers):
            raise ValueError("ModelConfig.multimodal.vision must be a tiled vision encoder (multimodal.max_num_tiles "
                             "> 0) read by cross_attention_layers of this decoder")
        if mm.extra_tokens and self.tie_embeddings:
            raise ValueError("ModelConfig.multimodal.extra_tokens (embedded, never predicted) need "
                             "tie_embeddings=False")
        if mm.max_num_tiles and (not self.image_size or self.execution.scan_layers):
            raise ValueError("ModelConfig.multimodal.max_num_tiles describes a tiled vision encoder: it needs "
                             "image_size and looped layers (execution.scan_layers=False)")

    def _check_sparsity(self):
        try:
            object.__setattr__(self, "attention_sparsity", sparsity_lib.coerce(self.attention_sparsity))
        except ValueError as e:
            raise ValueError(f"ModelConfig.attention_sparsity: {e}") from None
        pattern = self.attention_sparsity
        if pattern is not None and self.linformer_length is not None:
            raise ValueError("ModelConfig.attention_sparsity: Linformer's projected keys have no positions to pattern")
        if self.global_projections and not isinstance(pattern, sparsity_lib.Longformer):
            raise ValueError("ModelConfig.global_projections needs attention_sparsity=Longformer(...) (with globals=0 "
                             "its projections are held, unused, as HF's LongformerModel without global tokens)")
        if self.global_projections and (self.mla is not None or self.position in ("rope", "alibi", "relative")):
            raise ValueError("ModelConfig.global_projections (Longformer) projects plain heads without positions in "
                             "attention: not with mla, nor position rope/alibi/relative")

    def _check_attention_features(self):
        """The attention features this model uses must be ones execution.attention_impl computes
        (tfm.capabilities); with "auto", ones some backend computes."""
        uses = dict(dropout=("attention_dropout", self.attention_dropout > 0),
                    bias=("position='relative' (T5's relative position bias)", self.position == "relative"),
                    sparsity=("attention_sparsity", self.attention_sparsity is not None),
                    softcap=("attn_logit_softcap", self.attn_logit_softcap is not None),
                    sinks=("attention_sinks", self.attention_sinks))
        for feature, (field, used) in uses.items():
            if used and not self.execution.may_use(feature):
                able = capabilities.supporting(**{feature: True})
                raise ValueError(f"ModelConfig.{field} needs an attention backend that implements {feature} "
                                 f"({' or '.join(map(repr, able + ['auto']))}); execution.attention_impl="
                                 f"{self.execution.attention_impl!r} does not")

    def layer_span(self, layer: int) -> Optional[int]:
        """The aligned span layer `layer` attends within (None = not a "span" layer) under attention_pattern."""
        if self.attention_pattern is None:
            return None
        return self.attention_span if self.attention_pattern[layer % len(self.attention_pattern)] == "span" else None

    def layer_window(self, layer: int) -> Optional[int]:
        """The attention window of layer `layer` (None = global) under attention_pattern."""
        if self.attention_pattern is None:
            return self.sliding_window
        kind = self.attention_pattern[layer % len(self.attention_pattern)]
        return self.sliding_window if kind == "local" else None

    @property
    def pattern_period(self) -> int:
        """Layers per repeat of attention_pattern, mixer_pattern, ffn_pattern and position_pattern together (1 without any)."""
        patterns = (self.attention_pattern, self.mixer_pattern, self.ffn_pattern, self.position_pattern)
        return math.lcm(*(len(p) for p in patterns if p is not None)) if any(patterns) else 1

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`. A derived field (num_kv_heads, head_dim, num_decoder_layers,
        rope.dim) whose value is still its derivation follows the fields it derives from unless
        `changes` sets it: tiny(d_model=32, num_heads=4) of a 768-wide preset gets head_dim 8.
        rope, mla, execution and the mixer groups: an instance replaces the current one; a dict changes only the fields it
        names. The execution fields may also be named flat (replace(attention_impl="pallas")): they
        change `execution`."""
        changes = _nest_execution(changes)
        derived = dict(num_kv_heads=self.num_heads, head_dim=self.d_model // self.num_heads,
                       num_decoder_layers=self.num_layers)
        for name, value in derived.items():
            if name not in changes and getattr(self, name) == value and (name != "head_dim" or not
                                                                         self.d_model % self.num_heads):
                changes[name] = None
        rope = self.rope
        if rope.dim == self.head_dim:  # the whole head, whatever head_dim becomes
            rope = dataclasses.replace(rope, dim=None)
        if self.mla is not None and rope.dim == self.mla.rope_dim:  # follows mla.rope_dim
            rope = dataclasses.replace(rope, dim=None)
        changes["rope"] = RopeConfig.coerce(changes.get("rope"), rope)
        if self.local_rope is not None and changes.get("local_rope", self.local_rope) is not None:
            local = self.local_rope
            if local.dim == self.head_dim:
                local = dataclasses.replace(local, dim=None)
            changes["local_rope"] = RopeConfig.coerce(changes.get("local_rope"), local)
        changes["execution"] = ExecutionConfig.coerce(changes.get("execution"), self.execution)
        for group in mixer_groups():
            changes[group.FIELD] = group.coerce(changes.get(group.FIELD), getattr(self, group.FIELD))
        if self.mla is not None and changes.get("mla", self.mla) is not None:
            mla = self.mla if self.mla.value_dim != self.head_dim else dataclasses.replace(self.mla, value_dim=None)
            changes["mla"] = MlaConfig.coerce(changes.get("mla"), mla)
        if self.indexer is not None and changes.get("indexer", self.indexer) is not None:
            changes["indexer"] = IndexerConfig.coerce(changes.get("indexer"), self.indexer)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> "ModelConfig":
        """A ModelConfig from `dataclasses.asdict` of one, as JSON gives it back (lists for tuples),
        including records written before RoPE's fields were grouped into `rope` (rope_theta, ...) and
        before the execution settings were grouped into `execution` (attention_impl, ...)."""
        fields = _nest_execution({k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        legacy = {LEGACY_ROPE_FIELDS[k]: fields.pop(k) for k in list(fields) if k in LEGACY_ROPE_FIELDS}
        if legacy:
            fields["rope"] = {**legacy, **dict(fields.get("rope") or {})}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"ModelConfig has no field(s) {unknown}")
        return cls(**fields)


# The MoE-only fields of ModelConfig and ExecutionConfig, and the linear-time mixers' execution fields, by name
_MOE_PREFIXES = ("experts_", "router_", "shared_expert_", "dense_", "moe_", "capacity_")
_MIXER_PREFIX = "mixer_"


def _why_inapplicable(config: ModelConfig, path: str) -> Optional[str]:
    """Why the field at `path` ("rope.theta", "execution.moe_impl", "num_experts") has no effect on
    `config`, or None if it may: its group's switch is off."""
    group, _, field = path.rpartition(".")
    kinds = config.mixers_used | set(config.ffn_pattern or ())
    if group == "rope" and config.position != "rope":
        return f"position={config.position!r} has no RoPE; set position='rope' with it"
    if group in ("", "execution") and field.startswith(_MOE_PREFIXES):
        return "the model has no experts (num_experts=0); set num_experts with it" if not config.num_experts else None
    if group in {g.FIELD for g in mixer_groups()}:
        users = [k for k, g in MIXER_GROUPS.items() if g.FIELD == group]
        if not kinds & set(users):
            return (f"no layer is {' or '.join(map(repr, users))} (mixer_pattern={config.mixer_pattern}); "
                    f"set mixer_pattern with it")
    if group == "execution" and field.startswith(_MIXER_PREFIX) and not kinds & set(MIXER_GROUPS):
        return f"no layer has a linear-time mixer (mixer_pattern={config.mixer_pattern}); set mixer_pattern with it"
    schemes = {"alibi_bias_max": "alibi", "relative_buckets": "relative", "relative_max_distance": "relative"}
    if not group and field in schemes and config.position != schemes[field]:
        return f"position={config.position!r}; it applies with position={schemes[field]!r}"
    return None


def check_overrides(config: ModelConfig, overrides: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first of `overrides` (ModelConfig fields as `replace` takes them:
    groups as dicts or instances, execution's fields nested or flat) set to other than its default
    where `config`, the model built with them, has that setting's switch off: a RoPE field without
    position="rope", a MoE field without experts, a mixer group no layer uses, ALiBi's or T5's
    bias knobs under another position scheme. A preset's own values are not overrides."""
    groups = {g.FIELD: g for g in (RopeConfig, ExecutionConfig, *mixer_groups())}
    for name, value in _nest_execution(dict(overrides)).items():
        if name in groups and value is not None:
            given = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)
            defaults = groups[name]()
            items = [(f"{name}.{k}", v, getattr(defaults, k)) for k, v in given.items()]
        else:
            items = [(name, value, {f.name: f.default for f in dataclasses.fields(ModelConfig)}.get(name))]
        for path, v, default in items:
            why = _why_inapplicable(config, path)
            if why and _differs(v, default):
                raise ValueError(f"ModelConfig.{path}={v!r} cannot apply: {why}, or leave it out")


def _differs(value, default) -> bool:
    """Whether an override's value is other than the field's default (a list as the tuple it becomes)."""
    return (tuple(value) if isinstance(value, list) else value) != default


def _nest_execution(fields: dict) -> dict:
    """`fields` with ExecutionConfig's fields named flat (as ModelConfig had them) moved into `execution`."""
    flat = {name: fields.pop(name) for name in ExecutionConfig.names() if name in fields}
    if not flat:
        return fields
    nested = fields.get("execution")
    if isinstance(nested, ExecutionConfig):
        nested = dataclasses.asdict(nested)
    clash = sorted(set(flat) & set(nested or {}))
    if clash:
        raise ValueError(f"ModelConfig: {clash} given both flat and in execution; give them once")
    return {**fields, "execution": {**dict(nested or {}), **flat}}


def _block_sizes(value) -> Optional[BlockSizes]:
    """ExecutionConfig.attention_block_sizes as a (frozen, hashable) BlockSizes, or None."""
    if value is None or isinstance(value, BlockSizes):
        return value
    try:
        if isinstance(value, (tuple, list)):
            return BlockSizes(*value)
        return BlockSizes(**dict(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"ModelConfig.execution.attention_block_sizes={value!r}: {e}") from None
