"""Our own Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE) over the paged KV cache.

The graph runner must own every buffer, so the model is plain torch with a fixed layout:

- per layer: one fused QKV projection ``[(Hq + 2 * Hkv) * D, H]`` (+ bias for Qwen2), for Qwen3
  an RMSNorm over each query and key head (``q_norm``/``k_norm`` [D]) before RoPE, the output
  projection, and an MLP: dense (one fused gate/up projection ``[2 * I, H]`` and the down
  projection, SwiGLU) or, in a mixture-of-experts layer, a router ``[E, H]`` and the experts'
  stacked SwiGLU weights ``[E, 2 * I_moe, H]`` / ``[E, H, I_moe]`` (runtime/model/moe.py: top-k
  routing and the expert GEMMs on device, fixed-size buffers, no host synchronisation, so a MoE
  layer is captured like any other); RMSNorm before attention and before the MLP; residual adds;
- RoPE in the rotate-half convention of the Hugging Face checkpoints, with cos/sin tables for
  every position precomputed as buffers and indexed by the ``positions`` tensor (graph-safe);
- the forward pass is split into ``num_hidden_layers + 1`` *segments* separated by the attention
  calls (:meth:`LlamaForCausalLM.run_segment`, :meth:`LlamaForCausalLM.run_attention`);
  :meth:`LlamaForCausalLM.forward` is exactly their composition, so a piecewise graph replay,
  a full graph replay and eager execution run the same kernels on the same buffers.

Two kernel paths compute the same function. On CUDA with Triton (``kernels.available``) the
layer runs the fused kernels of ``graphserving.runtime.model.kernels``: residual adds folded into the
RMSNorms, RoPE applied together with the KV-cache write inside :meth:`run_attention`, SwiGLU in
one kernel, paged decode attention in one or two; at decode sizes each RMSNorm is also fused into
the projection after it (norm + QKV, add + norm + gate/up + SwiGLU: one kernel each). Everywhere
else (and with ``GRAPHSERVING_KERNELS=torch``) the pure-torch code below is the reference path.

Weights are loaded *in place* (:meth:`LlamaForCausalLM.load_weights` copies into the existing
parameters), so a reload keeps every data pointer and captured CUDA graphs stay valid.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import paged_attention, write_kv
from .forward_metadata import ForwardMetadata
from .config import ModelConfig, rope_inv_freq
from .moe import moe_experts, route_topk
from .parallel import TensorParallel, vocab_rows
from .verify_attention import VerificationRows, expand_for_verification, verify_attention
from .weight_names import expected_weight_names, names_covered


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, scaled in the input dtype (as the HF reference)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: [T, heads, D].
        cos, sin: [T, D] (the half-width table repeated twice).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """Parameters of one decoder layer (the computation lives in :class:`LlamaForCausalLM`)."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * d
        self.input_layernorm = _empty((hidden,), dtype, device)
        self.qkv_proj = _empty((qkv_rows, hidden), dtype, device)
        self.qkv_bias = _empty((qkv_rows,), dtype, device) if config.attention_bias else None
        self.o_proj = _empty((hidden, config.num_attention_heads * d), dtype, device)
        self.o_bias = _empty((hidden,), dtype, device) if config.o_proj_bias else None
        self.q_norm = _empty((d,), dtype, device) if config.qk_norm else None
        self.k_norm = _empty((d,), dtype, device) if config.qk_norm else None
        self.post_attention_layernorm = _empty((hidden,), dtype, device)
        self.is_moe = config.is_moe_layer(index)
        if self.is_moe:
            experts, inter = config.num_experts, config.moe_intermediate_size
            self.router = _empty((experts, hidden), dtype, device)
            self.experts_gate_up = _empty((experts, 2 * inter, hidden), dtype, device)
            self.experts_down = _empty((experts, hidden, inter), dtype, device)
            self.register_buffer("route_ticket", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)
            self.gate_up_proj = self.down_proj = None
        else:
            self.gate_up_proj = _empty((2 * config.intermediate_size, hidden), dtype, device)
            self.down_proj = _empty((hidden, config.intermediate_size), dtype, device)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM running over a paged KV cache.

    Args:
        config: the architecture.
        dtype: parameter and activation dtype (float32, bfloat16, float16).
        device: where parameters and the RoPE tables live.
        max_positions: rows of the RoPE tables (default ``config.max_model_len``); positions must
            stay below it.
        rope_freq_factors: llama.cpp's ``rope_freqs`` tensor, for ``rope_type == "freq_factors"``.
        parallel: this rank's tensor-parallel group (runtime/model/parallel.py; ``config`` is then
            the rank's sharded configuration and the weights its shards): the output of every
            row-parallel projection (O, down, an MoE layer's experts) is all-reduced before the
            residual add. None: one process holds the whole model.

    Parameters are allocated uninitialised; call :meth:`load_weights` before use.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        rope_freq_factors: torch.Tensor | None = None,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self._q_size = self.num_heads * self.head_dim
        self._kv_size = self.num_kv_heads * self.head_dim

        self.embed_tokens = _empty((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = _empty((config.hidden_size,), dtype, device)
        # vocabulary-parallel under tensor parallelism: this rank's rows only (a view where tied)
        first, rows = vocab_rows(config.vocab_size, parallel.layout) if parallel else (0, config.vocab_size)
        if not config.tie_word_embeddings:
            self.lm_head = _empty((rows, config.hidden_size), dtype, device)
        else:
            self.lm_head = self.embed_tokens if parallel is None else self.embed_tokens.detach().narrow(0, first, rows)

        self.max_positions = max_positions or config.max_model_len
        inv_freq, attention_scaling = rope_inv_freq(config, rope_freq_factors, device=device)
        # Same float32 arithmetic as the reference (positions * inv_freq, then cos/sin, scale, cast).
        freqs = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * attention_scaling).to(dtype), persistent=False)

    # ------------------------------------------------------------------ segments

    def uses_kernels(self) -> bool:
        """True when this model runs the fused Triton kernels (its parameters are on CUDA and
        ``kernels.available`` says so); decided per call, consistently by every segment."""
        return kernels.available(self.embed_tokens.device)

    @property
    def parallel_layout(self) -> str:
        """This rank's parallel layout as the graph key names it (``tp<N>-pp1``, runtime/model/parallel.py)."""
        return self.parallel.layout.label() if self.parallel is not None else "tp1-pp1"

    @property
    def num_segments(self) -> int:
        """Segments between attention calls: ``num_hidden_layers + 1``."""
        return self.num_layers + 1

    def _qkv(
        self, layer: DecoderLayer, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = rms_norm(hidden, layer.input_layernorm, self.config.rms_norm_eps)
        qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, self.config.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, self.config.rms_norm_eps)
        cos = self.cos_cache.index_select(0, positions)
        sin = self.sin_cache.index_select(0, positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial output summed over the tensor-parallel group (in
        place; ``x`` itself without one)."""
        return x if self.parallel is None else self.parallel.all_reduce(x)

    def _finish_layer(
        self, layer: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor, slot_mapping: torch.Tensor | None
    ) -> torch.Tensor:
        hidden = residual + self._reduce(F.linear(attn_out, layer.o_proj, layer.o_bias))
        x = rms_norm(hidden, layer.post_attention_layernorm, self.config.rms_norm_eps)
        if layer.is_moe:
            return hidden + self._reduce(self._moe(layer, x, slot_mapping))
        gate, up = F.linear(x, layer.gate_up_proj).chunk(2, dim=-1)
        return hidden + self._reduce(F.linear(F.silu(gate) * up, layer.down_proj))

    def _moe(self, layer: DecoderLayer, x: torch.Tensor, slot_mapping: torch.Tensor | None,
             routed: torch.Tensor | list[torch.Tensor] | None = None) -> torch.Tensor:
        """A mixture-of-experts MLP on normed rows ``x`` [T, H] -> [T, H] (runtime/model/moe.py).

        Rows whose slot is negative (``PAD_SLOT_ID``: padding of a graph's capture size) are routed
        to no expert: they take no expert's capacity and their output row is 0. ``routed``: what the
        caller's kernel computed (the skinny GEMM that also normed ``x``): ``x``'s router logits
        [T, E], or its routing ``[weights, ids]``; None: projected and routed here.
        """
        if routed is None or isinstance(routed, torch.Tensor):
            logits = routed if routed is not None else (
                self._linear(x, layer.router) if self.uses_kernels() else F.linear(x, layer.router))
            routed = route_topk(logits, self.config.num_experts_per_tok, self.config.norm_topk_prob, slot_mapping)
        return moe_experts(x, layer.experts_gate_up, layer.experts_down, *routed)

    def run_segment(
        self,
        i: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_out: torch.Tensor | kernels.DecodePartials | None,
        residual: torch.Tensor | None,
        slot_mapping: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run the ``i``-th segment (the code between two attention calls).

        Pure, row-independent tensor code: no host synchronisation and no branching on values, so
        it can be captured per token count T.

        Args:
            i: segment index, ``0 <= i <= num_hidden_layers``.
            input_ids: int64 [T] (read by segment 0 only).
            positions: int64 [T], RoPE positions (read by segments ``< num_hidden_layers``).
            attn_out: [T, Hq * D], layer ``i - 1``'s attention output (``None`` for ``i == 0``), or
                its uncombined partials (:meth:`run_attention`'s ``defer_combine``).
            residual: [T, H], the residual stream entering layer ``i - 1`` (``None`` for ``i == 0``).
            slot_mapping: int64 [T], the step's KV slots, read by mixture-of-experts layers only: a
                row with a negative slot is padding and is routed to no expert. ``None``: every row
                is real.

        Returns:
            ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], residual [T, H])`` of layer ``i`` for
            ``i < num_hidden_layers``; ``(hidden [T, H],)`` after the final norm for the last segment.
            On the fused-kernel path (:meth:`uses_kernels`) q and k are returned *before* RoPE
            (strided views of the QKV projection): :meth:`run_attention` rotates them as it writes
            the cache. Either way ``run_attention`` accepts what ``run_segment`` returned.

        Raises:
            IndexError: ``i`` out of range.
        """
        if not 0 <= i <= self.num_layers:
            raise IndexError(f"segment index {i} out of range 0..{self.num_layers}")
        if self.uses_kernels():
            return self._run_segment_fused(i, input_ids, attn_out, residual, slot_mapping)
        if i == 0:
            hidden = F.embedding(input_ids, self.embed_tokens)
        else:
            hidden = self._finish_layer(self.layers[i - 1], attn_out, residual, slot_mapping)
        if i == self.num_layers:
            return (rms_norm(hidden, self.norm, self.config.rms_norm_eps),)
        q, k, v = self._qkv(self.layers[i], hidden, positions)
        return q, k, v, hidden

    def _fuse_norm_linear(self, num_tokens: int, weight: torch.Tensor) -> bool:
        """Whether the norm before ``weight``'s projection runs fused with it (``kernels.use_fused_norm_linear``)."""
        return kernels.use_fused_norm_linear(num_tokens, self.config.hidden_size, weight.shape[0])

    def _gemv(self, num_tokens: int, weight: torch.Tensor, norm_only: bool = False) -> bool:
        """Whether a projection through ``weight`` of ``num_tokens`` rows runs as the skinny-GEMM PDL
        kernel (``kernels.use_gemv``: shapes and the device only; on the fused-kernel path only).
        ``norm_only``: the norm before it folded in and nothing after it (QKV, an MoE router)."""
        return kernels.use_gemv(num_tokens, weight.shape[0], weight.shape[1], self.config.hidden_size,
                                device=weight.device, norm_only=norm_only)

    def _linear(self, x: torch.Tensor | kernels.DecodePartials, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` on the fused-kernel path: ``kernels.gemv`` where :meth:`_gemv` says so, else cuBLAS;
        ``x`` may be a decode attention's uncombined partials (``kernels.combine_gemv``)."""
        if isinstance(x, tuple):  # kernels.DecodePartials (run_attention's defer_combine)
            return kernels.combine_gemv(x, weight, bias)
        if self._gemv(x.shape[0], weight):
            return kernels.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def _run_segment_fused(
        self, i: int, input_ids: torch.Tensor, attn_out: torch.Tensor | None, residual: torch.Tensor | None,
        slot_mapping: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`run_segment` with the fused kernels: each residual add happens inside the next norm.

        Where ``kernels.use_gemv`` accepts a projection (batch 1, small weights and hidden sizes: a bound
        per device) the skinny-GEMM PDL kernels run it, the norm before it and SwiGLU after it folded in
        (``kernels.fused_add_rms_norm_gemv``, ``kernels.gemv``: also O and down); else, where
        ``kernels.use_fused_norm_linear`` accepts the shapes, the norm and the projection after it are one
        kernel (``kernels.fused_add_rms_norm_linear``); else ``fused_add_rms_norm`` then cuBLAS (and
        ``silu_and_mul``). An MoE layer's router takes the skinny GEMM in the same way (the normed rows
        returned for the experts; with ``kernels.use_route_in_router`` the routing too), then :meth:`_moe`.
        Qwen3's q/k norms run in the kernel of :meth:`run_attention` that applies RoPE (:meth:`_qk_norm`).
        """
        eps = self.config.rms_norm_eps
        if i == 0:
            hidden, pending = F.embedding(input_ids, self.embed_tokens), None
        else:
            # hidden + pending is the residual stream entering layer i
            hidden, pending = self._mlp_fused(self.layers[i - 1], attn_out, residual, slot_mapping)
        if i == self.num_layers:
            return (kernels.fused_add_rms_norm(hidden, pending, self.norm, eps)[0],)
        layer = self.layers[i]
        if self._gemv(hidden.shape[0], layer.qkv_proj, norm_only=True):
            qkv, stream = kernels.fused_add_rms_norm_gemv(hidden, pending, layer.input_layernorm, layer.qkv_proj,
                                                          layer.qkv_bias, eps)
        elif self._fuse_norm_linear(hidden.shape[0], layer.qkv_proj):
            qkv, stream = kernels.fused_add_rms_norm_linear(hidden, pending, layer.input_layernorm, layer.qkv_proj,
                                                            layer.qkv_bias, eps)
        else:
            x, stream = kernels.fused_add_rms_norm(hidden, pending, layer.input_layernorm, eps)
            qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v, stream

    def _qk_norm(self, layer: DecoderLayer) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Qwen3's q/k norm (weights, eps) for the kernel that applies RoPE to apply first
        (``kernels.rope_and_write_kv``, ``kernels.rope_write_and_decode_attention`` or the
        verification attention), so that it takes no kernel of its own. None without q/k norm."""
        if layer.q_norm is None:
            return None
        return layer.q_norm, layer.k_norm, self.config.rms_norm_eps

    def _mlp_fused(
        self, layer: DecoderLayer, attn_out: torch.Tensor | kernels.DecodePartials, residual: torch.Tensor,
        slot_mapping: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, residual add, post-attention norm and MLP of ``layer`` on the fused
        kernels: ``(mlp_out [T, H], residual_stream [T, H])``, their sum being the layer's output."""
        eps = self.config.rms_norm_eps
        o = self._reduce(self._linear(attn_out, layer.o_proj, layer.o_bias))
        if layer.is_moe:
            norm, routed = layer.post_attention_layernorm, None
            if not self._gemv(o.shape[0], layer.router, norm_only=True):
                x, stream = kernels.fused_add_rms_norm(o, residual, norm, eps)
            elif kernels.use_route_in_router():  # the norm folded into the router, the routing into its last program
                _, stream, x, *routed = kernels.fused_add_rms_norm_gemv_route(
                    o, residual, norm, layer.router, eps, top_k=self.config.num_experts_per_tok,
                    normalize=self.config.norm_topk_prob, slot_mapping=slot_mapping, ticket=layer.route_ticket)
            else:  # the norm folded into the router
                routed, stream, x = kernels.fused_add_rms_norm_gemv(o, residual, norm, layer.router, None, eps,
                                                                    return_normed=True)
            return self._reduce(self._moe(layer, x, slot_mapping, routed)), stream
        if self._gemv(o.shape[0], layer.gate_up_proj):
            act, stream = kernels.fused_add_rms_norm_gemv(
                o, residual, layer.post_attention_layernorm, layer.gate_up_proj, None, eps, activation="silu_and_mul")
        elif self._fuse_norm_linear(o.shape[0], layer.gate_up_proj):
            act, stream = kernels.fused_add_rms_norm_linear(
                o, residual, layer.post_attention_layernorm, layer.gate_up_proj, None, eps, activation="silu_and_mul")
        else:
            x, stream = kernels.fused_add_rms_norm(o, residual, layer.post_attention_layernorm, eps)
            act = kernels.silu_and_mul(F.linear(x, layer.gate_up_proj))
        return self._reduce(self._linear(act, layer.down_proj)), stream

    def run_attention(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: ForwardMetadata,
        kv_cache: torch.Tensor,
        rows: VerificationRows | None = None,
        defer_combine: bool = False,
    ) -> torch.Tensor | kernels.DecodePartials:
        """Layer ``i``'s attention: write K/V at ``meta.slot_mapping``, attend over the paged cache.

        A verification batch (``meta.uniform_query_len > 1``, ForwardMetadata) writes every row's
        K/V first and then attends with its rows as decode rows (``verify_attention``): graph-safe,
        and never the fused RoPE-write-attend decode kernel, in which rows of one request, reading
        each other's keys, would race.

        Args:
            q: [T, Hq, D]; k, v: [T, Hkv, D], as returned by :meth:`run_segment` (on the fused path
                RoPE is applied here, in the kernel that writes the cache, or for uniform decode with
                ``kernels.use_fused_rope_decode`` in the attention kernel itself).
            kv_cache: layer ``i``'s cache [2, num_blocks, block_size, Hkv, D].
            rows: a verification batch's decode rows (:meth:`verification_rows`, built once per
                forward pass and shared by every layer); None: built here.
            defer_combine: a one-row decode step whose O projection is the skinny GEMM may return
                the attention's split partials (``kernels.DecodePartials``) for the next segment's
                O projection to merge (``kernels.combine_gemv``); the piecewise runner, which
                copies the output into a buffer, leaves it False.

        Returns:
            [T, Hq * D], or with ``defer_combine`` possibly ``kernels.DecodePartials``.

        Raises:
            ValueError: a verification batch whose token rows are not ``R * uniform_query_len``.
        """
        fused = self.uses_kernels()
        qk_norm = self._qk_norm(self.layers[i]) if fused else None
        if meta.uniform_query_len > 1:
            rows = rows if rows is not None else self.verification_rows(meta)
            rope = (meta.positions, self.cos_cache, self.sin_cache) if fused else None
            return verify_attention(q, k, v, kv_cache, meta.slot_mapping, rows, self.scale, rope=rope,
                                    qk_norm=qk_norm)
        if fused:
            num_tokens = q.shape[0]
            defer = defer_combine and num_tokens == 1 and self._gemv(1, self.layers[i].o_proj)
            if (kernels.use_fused_rope_decode(self.head_dim) and meta.max_query_len == 1
                    and num_tokens <= meta.block_table.shape[0]):
                # uniform decode: RoPE and the cache write inside the attention kernel
                out = kernels.rope_write_and_decode_attention(
                    q, k, v, meta.positions[:num_tokens], self.cos_cache, self.sin_cache, kv_cache,
                    meta.slot_mapping[:num_tokens], meta.block_table[:num_tokens], meta.seq_lens[:num_tokens],
                    self.scale, defer_combine=defer, qk_norm=qk_norm)
                return out if isinstance(out, tuple) else out.reshape(num_tokens, -1)
            q, _ = kernels.rope_and_write_kv(q, k, v, meta.positions, self.cos_cache, self.sin_cache, kv_cache,
                                             meta.slot_mapping, return_k=False, qk_norm=qk_norm)
            return paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, defer_combine=defer)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)

    @staticmethod
    def verification_rows(meta: ForwardMetadata) -> VerificationRows | None:
        """The decode rows of a verification batch (``expand_for_verification``: device ops of
        fixed shapes, graph-safe), or None when ``meta.uniform_query_len <= 1``."""
        if meta.uniform_query_len <= 1:
            return None
        return expand_for_verification(meta.seq_lens, meta.block_table, meta.uniform_query_len)

    def forward(self, meta: ForwardMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """All token rows through the model: hidden states [T, H] after the final norm.

        Exactly the composition ``segment 0, attention 0, segment 1, ..., attention L-1, segment L``.
        """
        rows = self.verification_rows(meta)
        outs = self.run_segment(0, meta.input_ids, meta.positions, None, None, meta.slot_mapping)
        for i in range(self.num_layers):
            q, k, v, residual = outs
            attn_out = self.run_attention(i, q, k, v, meta, kv_caches[i], rows, defer_combine=True)
            outs = self.run_segment(i + 1, meta.input_ids, meta.positions, attn_out, residual, meta.slot_mapping)
        return outs[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the given hidden rows: [S, H] -> float32 [S, vocab_size].

        On the fused-kernel path where ``kernels.use_gemv`` accepts the LM head (by default one row of
        a model of hidden size up to 2048, ``skinny_gemm.GEMV_MAX_HIDDEN``, or of a size listed for
        the device in ``skinny_gemm.WIDE_HIDDEN_DEVICES``; weights up to 1 GiB) the skinny
        GEMM writes float32 directly (accumulated in float32, no rounding to the model dtype in
        between); otherwise, on CUDA for a 16-bit model, cuBLAS writes float32 too (``torch.mm``'s
        ``out_dtype``: float32 accumulation, no rounding to the model dtype in between); elsewhere
        cuBLAS (or the CPU) in the model dtype, then a cast. Under tensor parallelism each rank
        computes its vocabulary rows and every rank gets all of them (an all-gather).

        ``out``: float32 [S, vocab_size] to write the logits into (a graph's static logits buffer:
        no copy after the product where the product can write it), or ``None`` for a fresh tensor.
        """
        tp = self.parallel is not None
        target = out if not tp else None
        if self.uses_kernels() and self._gemv(hidden.shape[0], self.lm_head):
            logits = kernels.gemv(hidden, self.lm_head, out_dtype=torch.float32, out=target)
        elif kernels.mm_writes_float32(hidden):
            weight = self.lm_head.t()
            logits = (torch.mm(hidden, weight, out_dtype=torch.float32) if target is None
                      else torch.mm(hidden, weight, out_dtype=torch.float32, out=target))
        else:
            logits = F.linear(hidden, self.lm_head).float()
        logits = logits if not tp else self.parallel.all_gather_vocab(logits)
        if out is not None and logits is not out:
            out.copy_(logits)
            return out
        return logits

    # ------------------------------------------------------------------ weights

    _LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    _EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

    def _target(self, name: str) -> tuple[torch.Tensor, slice | tuple | None] | None:
        """The parameter (and index into a fused one) a Hugging Face weight name maps to."""
        if name in ("model.embed_tokens.weight",):
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm, None
        if name == "lm_head.weight":
            return (None if self.config.tie_word_embeddings else (self.lm_head, None))
        match = self._LAYER_KEY.match(name)
        if match is None:
            raise KeyError(name)
        index, rest = int(match.group(1)), match.group(2)
        if index >= self.num_layers:
            raise KeyError(name)
        layer = self.layers[index]
        table = {**self._attention_targets(layer), **(self._moe_targets(layer, rest) if layer.is_moe
                                                      else self._mlp_targets(layer))}
        if rest not in table or table[rest][0] is None:
            raise KeyError(name)
        return table[rest]  # type: ignore[return-value]

    def _attention_targets(self, layer: DecoderLayer) -> dict[str, tuple[torch.Tensor | None, slice | None]]:
        q, kv = self._q_size, self._kv_size
        return {
            "input_layernorm.weight": (layer.input_layernorm, None),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm, None),
            "self_attn.q_proj.weight": (layer.qkv_proj, slice(0, q)),
            "self_attn.k_proj.weight": (layer.qkv_proj, slice(q, q + kv)),
            "self_attn.v_proj.weight": (layer.qkv_proj, slice(q + kv, q + 2 * kv)),
            "self_attn.q_proj.bias": (layer.qkv_bias, slice(0, q)),
            "self_attn.k_proj.bias": (layer.qkv_bias, slice(q, q + kv)),
            "self_attn.v_proj.bias": (layer.qkv_bias, slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj.weight": (layer.o_proj, None),
            "self_attn.o_proj.bias": (layer.o_bias, None),
            "self_attn.q_norm.weight": (layer.q_norm, None),
            "self_attn.k_norm.weight": (layer.k_norm, None),
        }

    def _mlp_targets(self, layer: DecoderLayer) -> dict[str, tuple[torch.Tensor, slice | None]]:
        inter = self.config.intermediate_size
        return {
            "mlp.gate_proj.weight": (layer.gate_up_proj, slice(0, inter)),
            "mlp.up_proj.weight": (layer.gate_up_proj, slice(inter, 2 * inter)),
            "mlp.down_proj.weight": (layer.down_proj, None),
        }

    def _moe_targets(self, layer: DecoderLayer, rest: str) -> dict[str, tuple[torch.Tensor, slice | tuple | None]]:
        """A mixture-of-experts layer's MLP names: the router (``mlp.gate.weight``), and the experts
        either one by one (``mlp.experts.{e}.gate_proj.weight``, the Hugging Face checkpoint layout)
        or stacked over experts (transformers 5's ``mlp.experts.gate_up_proj`` [E, 2I, H] and
        ``mlp.experts.down_proj`` [E, H, I]; the GGUF loader's ``mlp.experts.gate_proj`` /
        ``up_proj`` [E, I, H])."""
        inter = self.config.moe_intermediate_size
        gate, up = slice(0, inter), slice(inter, 2 * inter)
        table: dict[str, tuple[torch.Tensor, slice | tuple | None]] = {
            "mlp.gate.weight": (layer.router, None),
            "mlp.experts.gate_up_proj": (layer.experts_gate_up, None),
            "mlp.experts.gate_proj": (layer.experts_gate_up, (slice(None), gate)),
            "mlp.experts.up_proj": (layer.experts_gate_up, (slice(None), up)),
            "mlp.experts.down_proj": (layer.experts_down, None),
        }
        match = self._EXPERT_KEY.match(rest)
        if match is not None and int(match.group(1)) < self.config.num_experts:
            expert, part = int(match.group(1)), match.group(2)
            table[rest] = ((layer.experts_down, (expert,)) if part == "down" else
                           (layer.experts_gate_up, (expert, gate if part == "gate" else up)))
        return table

    def expected_weight_names(self) -> list[str]:
        """Every Hugging Face weight name :meth:`load_weights` needs (``weight_names.expected_weight_names``)."""
        return expected_weight_names(self.config)

    IGNORED_WEIGHTS = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
    """Checkpoint entries that are derived buffers, not weights (skipped)."""

    @torch.no_grad()
    def load_weights(
        self, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> None:
        """Copy weights (Hugging Face names) into the existing parameters, in place.

        Every copy is ``param.data[rows].copy_(tensor)``: no parameter is re-allocated, so data
        pointers are stable across reloads and CUDA graphs captured before a reload replay with the
        new weights (the graph runner relies on this). Values are cast to the model dtype.
        With tied embeddings, ``lm_head.weight`` in the checkpoint is skipped.

        Raises:
            KeyError: a name that belongs to no parameter of this configuration.
            ValueError: a shape mismatch (naming the weight and both shapes), or, when ``strict``,
                weights missing from ``state`` (listed).
        """
        items = state.items() if isinstance(state, Mapping) else state
        seen: set[str] = set()
        for name, tensor in items:
            if self.IGNORED_WEIGHTS.search(name):
                continue
            try:
                target = self._target(name)
            except KeyError:
                raise KeyError(f"weight {name!r} does not belong to a {self.config.architecture} model "
                               f"with this configuration") from None
            if target is None:
                continue
            param, rows = target
            dest = param.data if rows is None else param.data[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            seen.update(names_covered(name, self.config.num_experts))
        if strict:
            missing = [n for n in self.expected_weight_names() if n not in seen]
            if missing:
                shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
                raise ValueError(f"{len(missing)} weights missing from the checkpoint: {shown}")
