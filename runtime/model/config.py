"""The architecture of a Llama-family decoder, read from a Hugging Face config or GGUF metadata.

One frozen :class:`ModelConfig` describes every model our own implementation
(runtime/model/llama.py) serves: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3 (per-head q/k
RMSNorm) and Qwen3-MoE (mixture-of-experts MLPs). Field names follow the
Hugging Face ``config.json`` keys; the GGUF keys they come from are those llama.cpp writes
(``{arch}.block_count``, ``{arch}.attention.head_count``, ...; see gguf-py's ``Keys``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""Values of :attr:`ModelConfig.architecture` (Hugging Face ``model_type`` / GGUF ``general.architecture``)."""

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
"""GGUF ``general.architecture`` values we load, and the :attr:`ModelConfig.architecture` each becomes."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")
"""RoPE variants :func:`rope_inv_freq` implements; ``freq_factors`` is llama.cpp's ``rope_freqs`` tensor."""


class ConfigError(ValueError):
    """A configuration field is missing or has a value we cannot serve; the message names the field."""


class UnsupportedConfigError(ConfigError):
    """The configuration describes an architecture or feature this runtime does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder-only model.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: model width H.
        intermediate_size: SwiGLU width I.
        num_hidden_layers: decoder layers L.
        num_attention_heads: query heads Hq.
        num_key_value_heads: key/value heads Hkv (GQA when Hkv < Hq; Hq % Hkv == 0).
        head_dim: D, per-head width (``hidden_size // num_attention_heads`` unless given).
        rms_norm_eps: epsilon inside RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: ``None`` for plain RoPE, else a dict with ``rope_type`` in
            :data:`SUPPORTED_ROPE_TYPES` and that variant's parameters (Hugging Face names).
        max_position_embeddings: longest context the model was configured for.
        tie_word_embeddings: the LM head shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2; Llama with ``attention_bias``).
        bos_token_id: beginning-of-sequence token, or ``None``.
        eos_token_ids: every token id that ends a generation.
        o_proj_bias: the output projection carries a bias (Llama with ``attention_bias: true``).
        sliding_window: Mistral/Qwen2 sliding-window width when the model uses one; we serve such
            models only up to that length (see :attr:`max_model_len`), where full attention is exact.
        qk_norm: an RMSNorm over each query and key head (width D) after the projection and before
            RoPE (Qwen3's ``q_norm`` / ``k_norm``).
        num_experts: experts E of each mixture-of-experts layer; 0 for a dense model.
        num_experts_per_tok: experts k each token is routed to (top-k).
        moe_intermediate_size: SwiGLU width of one expert.
        norm_topk_prob: the k routing weights are renormalised to sum to 1 (Qwen3-MoE's
            ``norm_topk_prob``); otherwise they are the softmax probabilities themselves.
        moe_layers: indices of the layers whose MLP is a mixture of experts (the others are dense,
            width ``intermediate_size``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedConfigError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.moe_layers:
            if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                                  f"({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size!r}")
            if any(not 0 <= i < self.num_hidden_layers for i in self.moe_layers):
                raise ConfigError(f"moe_layers {self.moe_layers} name layers outside 0..{self.num_hidden_layers - 1}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedConfigError(
                f"rope_scaling.rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head (the GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is a mixture of experts."""
        return index in self.moe_layers

    @property
    def moe_layout(self) -> str:
        """The MoE topology a captured graph bakes in: ``e<E>-top<k>-ep1`` (one process holds every
        expert), ``none`` for a dense model. Part of every graph key (``GraphKeyContract.moe_layout``)."""
        if not self.moe_layers:
            return "none"
        return f"e{self.num_experts}-top{self.num_experts_per_tok}-ep1"

    @property
    def mlp_activation_width(self) -> int:
        """Per-token width of the widest MLP intermediate (pure): ``I`` for a dense layer;
        ``k * (I_moe + H)`` for a mixture-of-experts layer (the k experts' SwiGLU outputs and their
        k down-projected rows before the weighted sum)."""
        widths = []
        if len(self.moe_layers) < self.num_hidden_layers:
            widths.append(self.intermediate_size)
        if self.moe_layers:
            widths.append(self.num_experts_per_tok * (self.moe_intermediate_size + self.hidden_size))
        return max(widths)

    @property
    def rope_type(self) -> str:
        """The RoPE variant, ``"default"`` when unscaled."""
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output tokens) served exactly.

        ``max_position_embeddings``, capped by the sliding window (we implement full attention,
        which equals sliding-window attention only within the window). For ``dynamic`` RoPE the
        Hugging Face reference rescales only beyond ``max_position_embeddings``, so this bound also
        keeps dynamic RoPE exact.
        """
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        return limit

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict.

        Reads both the transformers 4.x layout (``rope_theta`` + ``rope_scaling`` with ``type`` or
        ``rope_type``) and the 5.x layout (``rope_parameters`` holding ``rope_theta``).

        Qwen3-MoE layers: layer ``i`` is a mixture of experts when ``num_experts`` (or the 5.x name
        ``num_local_experts``) > 0, ``i`` is not in ``mlp_only_layers`` and
        ``(i + 1) % decoder_sparse_step == 0`` (transformers' ``Qwen3MoeDecoderLayer``).

        Raises:
            UnsupportedConfigError: ``model_type`` is not one of :data:`SUPPORTED_ARCHITECTURES`, or
                a feature we do not implement is switched on (``mlp_bias``, an unknown RoPE type, a
                non-SiLU activation, shared experts).
            ConfigError: a required field is missing or invalid (the message names it).
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedConfigError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if config.get("mlp_bias"):
            raise UnsupportedConfigError("mlp_bias=true is not supported")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedConfigError(f"hidden_act {act!r} is not supported; only silu (SwiGLU)")

        def require(name: str) -> Any:
            if config.get(name) is None:
                raise ConfigError(f"config.json lacks required field {name!r}")
            return config[name]

        hidden = int(require("hidden_size"))
        heads = int(require("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)

        max_pos = int(config.get("max_position_embeddings") or 2048)
        rope_theta, rope_scaling = _hf_rope(config, max_pos)

        if model_type == "qwen2":
            attention_bias, o_bias = True, False
            window = config.get("sliding_window") if config.get("use_sliding_window") else None
        elif model_type in ("qwen3", "qwen3_moe"):
            attention_bias = o_bias = bool(config.get("attention_bias", False))
            window = config.get("sliding_window") if config.get("use_sliding_window") else None
        else:
            attention_bias = o_bias = bool(config.get("attention_bias", False))
            window = config.get("sliding_window") if model_type == "mistral" else None

        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        bos = config.get("bos_token_id")
        layers = int(require("num_hidden_layers"))
        moe = _hf_moe_fields(config, layers) if model_type == "qwen3_moe" else {}
        return cls(
            architecture=model_type,
            vocab_size=int(require("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(require("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            o_proj_bias=o_bias,
            sliding_window=int(window) if window else None,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe,
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """Build from the metadata (and tensor list) of a ``gguf.GGUFReader``.

        Keys read (``{arch}`` is ``general.architecture``): ``{arch}.block_count``,
        ``.embedding_length``, ``.feed_forward_length``, ``.attention.head_count``,
        ``.attention.head_count_kv``, ``.attention.key_length``, ``.attention.layer_norm_rms_epsilon``,
        ``.rope.freq_base``, ``.rope.scaling.{type,factor,original_context_length}``,
        ``.context_length``, ``.vocab_size``, and ``tokenizer.ggml.{bos,eos,eot,eom}_token_id``.
        The LM head is tied when the file has no ``output.weight``; a ``rope_freqs.weight`` tensor
        (llama.cpp's baked Llama 3.1 frequency factors) becomes ``rope_type = "freq_factors"``.

        Qwen3 (``qwen3``, ``qwen3moe``): q/k norms when the file has ``blk.0.attn_q_norm.weight``;
        ``{arch}.expert_count``, ``.expert_used_count``, ``.expert_feed_forward_length``, and the
        layers holding a ``blk.{i}.ffn_gate_inp.weight`` router are the MoE layers; the top-k
        weights are renormalised (``{arch}.expert_weights_norm``, default true: llama.cpp's Qwen3-MoE
        graph normalises them).

        Raises:
            UnsupportedConfigError: the architecture is not one of :data:`GGUF_ARCHITECTURES`.
            ConfigError: a required key is missing.
        """
        meta = gguf_metadata(reader)
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedConfigError(
                f"GGUF general.architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = ...) -> Any:
            full = f"{arch}.{name}"
            if full in meta:
                return meta[full]
            if default is ...:
                raise ConfigError(f"GGUF metadata lacks required key {full!r}")
            return default

        tensor_names = {t.name for t in reader.tensors}
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = int(key("attention.head_count_kv", heads))
        head_dim = int(key("attention.key_length", hidden // heads))
        max_pos = int(key("context_length", 2048))
        vocab = _gguf_vocab_size(key("vocab_size", None), meta, reader)

        rope_scaling: dict[str, Any] | None = None
        scaling_type = key("rope.scaling.type", None)
        if scaling_type in ("linear", "yarn"):
            rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
            if scaling_type == "yarn":
                rope_scaling["original_max_position_embeddings"] = int(
                    key("rope.scaling.original_context_length", max_pos)
                )
        elif scaling_type not in (None, "none"):
            raise UnsupportedConfigError(f"GGUF {arch}.rope.scaling.type {scaling_type!r} is not supported")
        if "rope_freqs.weight" in tensor_names:
            rope_scaling = {"rope_type": "freq_factors"}  # the factors themselves are a tensor

        eos_ids = list(dict.fromkeys(int(meta[f"tokenizer.ggml.{name}"]) for name in (
            "eos_token_id", "eot_token_id", "eom_token_id") if meta.get(f"tokenizer.ggml.{name}") is not None))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        layers = int(key("block_count"))
        moe_layers = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
        moe: dict[str, Any] = {}
        if moe_layers:
            moe = dict(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                       moe_intermediate_size=int(key("expert_feed_forward_length")),
                       norm_topk_prob=bool(key("expert_weights_norm", True)), moe_layers=moe_layers)
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length", moe.get("moe_intermediate_size", ...))),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            **moe,
        )


def _gguf_vocab_size(declared: Any, meta: dict[str, Any], reader: Any) -> int:
    """The vocabulary size: the ``{arch}.vocab_size`` key, else the token list's length, else the
    embedding's rows.

    Raises:
        ConfigError: none of the three is in the file.
    """
    if declared is not None:
        return int(declared)
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConfigError("GGUF file has no vocab_size key, no token list and no token_embd.weight")
    return int(embd.shape[-1])


def _hf_rope(config: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a ``config.json`` in the transformers 4.x or 5.x layout.

    Raises:
        UnsupportedConfigError: ``partial_rotary_factor`` != 1.
    """
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling")
    if legacy:
        params = {**params, **legacy}
    rope_theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_scaling: dict[str, Any] | None = None
    if rope_type not in (None, "default"):
        rope_scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
        rope_scaling["rope_type"] = rope_type
        if rope_type in ("llama3", "yarn"):
            rope_scaling.setdefault(
                "original_max_position_embeddings", config.get("original_max_position_embeddings", max_pos)
            )
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
    return rope_theta, rope_scaling


def _hf_moe_fields(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The MoE fields of a ``qwen3_moe`` ``config.json`` (see :meth:`ModelConfig.from_hf_config`).

    Raises:
        UnsupportedConfigError: shared experts (``shared_expert_intermediate_size`` > 0), which
            Qwen3-MoE does not have and we do not implement.
        ConfigError: a required field is missing.
    """
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedConfigError("shared experts (shared_expert_intermediate_size) are not supported")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    if not layers:
        return {}
    for name in ("num_experts_per_tok", "moe_intermediate_size"):
        if config.get(name) is None:
            raise ConfigError(f"config.json lacks required field {name!r}")
    return dict(num_experts=experts, num_experts_per_tok=int(config["num_experts_per_tok"]),
                moe_intermediate_size=int(config["moe_intermediate_size"]),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)), moe_layers=layers)


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """The scalar and small-array metadata of a ``gguf.GGUFReader`` as plain Python values.

    Uses ``ReaderField.contents()`` from gguf-py; the huge tokenizer arrays (``tokens``, ``merges``,
    ``scores``, ``token_type``) are returned too, as lists, since callers may need them.
    """
    cached = getattr(reader, "_graphserving_metadata", None)
    if cached is not None:
        return cached
    meta: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = fld.contents()
    reader._graphserving_metadata = meta
    return meta


def rope_inv_freq(config: ModelConfig, freq_factors: Any = None, device: Any = None) -> tuple[Any, float]:
    """RoPE inverse frequencies (float32 [D/2]) and the cos/sin scale for a config.

    The formulas are those of the published methods, written to produce the same float32 values as
    the Hugging Face reference (``transformers.modeling_rope_utils``):
    - default: ``1 / theta ** (arange(0, D, 2) / D)``;
    - ``linear`` (position interpolation, kaiokendev): default / ``factor``;
    - ``dynamic`` (NTK-aware, bloc97/emozilla): equals default up to ``max_position_embeddings``,
      the only range we serve (see :attr:`ModelConfig.max_model_len`);
    - ``llama3`` (Llama 3.1 report): wavelengths above ``original_max / low_freq_factor`` divided by
      ``factor``, below ``original_max / high_freq_factor`` kept, smoothly interpolated in between;
    - ``yarn`` (Peng et al. 2023, arXiv:2309.00071): ramp between interpolated and extrapolated
      frequencies over the correction range from ``beta_fast``/``beta_slow``; cos/sin scaled by
      ``attention_factor`` (default ``0.1 * ln(factor) + 1``);
    - ``freq_factors``: llama.cpp's ``rope_freqs`` tensor, default divided elementwise by it.

    Computed on ``device`` (default CPU), as the reference does, so the float32 values agree there.

    Returns:
        ``(inv_freq, attention_scaling)``: float32 tensor [head_dim // 2] on ``device``, and a float.
    """
    import torch

    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    params = config.rope_scaling or {}
    rope_type = config.rope_type
    scaling = 1.0
    if rope_type in ("default", "dynamic"):
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        factor = params.get("factor")
        old_len = params["original_max_position_embeddings"]
        if factor is None:
            factor = config.max_position_embeddings / old_len
        factor = float(factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        scaling = params.get("attention_factor")
        if scaling is None:
            if params.get("mscale") and params.get("mscale_all_dim"):
                scaling = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
            else:
                scaling = mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1).to(device)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        keep = 1 - ramp
        inv_freq = interpolation * (1 - keep) + extrapolation * keep
    elif rope_type == "freq_factors":
        if freq_factors is None:
            raise ConfigError("rope_type 'freq_factors' needs the rope_freqs tensor")
        inv_freq = inv_freq / torch.as_tensor(freq_factors, dtype=torch.float32, device=inv_freq.device).reshape(-1)
    else:  # pragma: no cover - guarded by ModelConfig.__post_init__
        raise UnsupportedConfigError(f"rope_type {rope_type!r} is not supported")
    return inv_freq, float(scaling)
