"""Mixture-of-experts on device: top-k routing and the grouped expert GEMMs, CUDA-graph capturable.

The router produces different tokens-per-expert every step, so nothing here may depend on the
routing on the host: every buffer's shape and every grid is a function of ``(T, k, E, BLOCK_M)``
and the weights' shapes only (:func:`align_buffer_shapes`), counts stay on device, and nothing
synchronises. A captured graph therefore replays for any routing. A call is six kernels:

1. :func:`fused_route_topk` (one program per token): float32 softmax over the E router logits,
   top-k by k rounds of arg-max, optional renormalisation; padding rows (negative KV slot) get id
   E (the sentinel: routed to no expert) and weight 0.
2. ``_rank_kernel`` then ``_place_kernel``: the T*k (token, slot) *pairs* grouped by expert.
   Each expert's group is padded to a multiple of ``BLOCK_M`` rows, so that an M-block of the
   GEMMs below holds pairs of one expert only; ``block_expert[b]`` names the expert of M-block
   ``b`` (E for the blocks past the padded total: those programs exit at once). Program e of the
   first kernel numbers the pairs that chose expert e in pair order (a prefix sum over the ids)
   and counts them; the second derives the padded group starts from the E counts (a prefix sum)
   and writes each pair to ``start[e] + rank``. Stable and deterministic (no atomics), two launches
   and one chunk of pairs per program at every decode size. Sentinel pairs are counted nowhere
   and take no M-block.
3. ``_gate_up_kernel``: grid (M-blocks, I / BLOCK_N). ``silu(x @ Wg_e.T) * (x @ Wu_e.T)`` for the
   rows of one M-block, two float32 accumulators, the SwiGLU in the epilogue; the result goes to
   the pair's row of an ``[T*k, I]`` buffer.
4. ``_down_kernel``: grid (M-blocks, H / BLOCK_N). ``act @ Wd_e.T`` times the pair's routing
   weight, into the pair's row of a ``[T*k, H]`` buffer.
5. ``_sum_slots_kernel``: grid (T, H / BLOCK_H). The k rows of each token summed in slot order in
   float32 (deterministic: no atomics); a sentinel slot contributes nothing, so a padding row's
   output is exactly 0 and no padding row touches another row.

Each expert's weights are read ``ceil(rows_e / BLOCK_M)`` times: once per chosen expert at
decode sizes (T=1, k=8: eight M-blocks, one per expert, one valid row each).

The direct decode path (:data:`DIRECT_MAX_PAIRS` pairs or fewer, :class:`MoEConfig` ``direct``;
``moe_direct.py``) replaces steps 2-5 with two kernels: ``_gate_up_direct_kernel``, grid (T*k, I / BLOCK_N), each
program a matrix-vector product of its pair's expert's gate and up rows with the token's row (a
sentinel pair's program exits at once); and ``_down_direct_kernel``, grid (T, H / BLOCK_N), each
program the token's k down projections in slot order, weighted and summed in float32 like steps
4-5. Three kernels per call instead of six; an expert chosen by several of the few tokens is
read once per pair.

Numerics, per pair (as ``graphserving.runtime.model.moe.moe_experts_reference``, i.e. as
transformers' ``Qwen3MoeExperts``): the gate and up projections accumulate in float32 (IEEE for
float32 inputs, no TF32) and are rounded to the activation dtype; ``silu(gate)`` is rounded; the
product with ``up`` is rounded; the down projection accumulates in float32 and is rounded; the
routing weight is rounded to the activation dtype and the product rounded. Only the sum over the
k slots differs: float32 in slot order, rounded once (as transformers' ``batched_mm`` and
``grouped_mm`` experts implementations do; the reference, like its eager ``index_add_`` loop,
adds in ascending expert order in the activation dtype, rounding after every add), so float32
results agree up to the order of summation and bfloat16 ones within a few units in the last
place of the output.

Meta-parameters come from :func:`choose_config` (shapes only: no autotuning, so warmup compiles
everything a capture needs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton.language as tl

from .backend import DeviceKernel, device_function, next_power_of_2
from .moe_direct import fused_moe_direct
from .pdl import pdl_enter

ALIGN_CHUNK = 4096
"""Pairs an alignment program holds at once (32 per thread at 4 warps): every decode capture size
(T <= 512 at k = 8) is one chunk."""

SHARED_MEMORY_BUDGET = 160 * 1024
"""Bytes of shared memory the K pipeline of a GEMM may use per program (H100/H200: 228 KB per SM)."""


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most M-blocks any routing of ``num_pairs`` pairs over ``num_experts`` experts needs.

    ``sum_e ceil(c_e / B)`` with ``sum_e c_e <= N`` over at most ``m = min(E, N)`` non-empty
    experts is at most ``floor((N + m * (B - 1)) / B)`` (each ceiling adds at most ``B - 1``
    rows of padding); ``m - 1`` experts of one pair and the rest in one reach it (where the
    tokens allow it: a token's k experts are distinct).
    """
    if num_pairs <= 0:
        return 0
    m = min(num_experts, num_pairs)
    return (num_pairs + m * (block_m - 1)) // block_m


def align_buffer_shapes(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the alignment's int32 device buffers: a pure function of ``(T, k, E, BLOCK_M)``.

    ``sorted_pairs`` [max_blocks * BLOCK_M] (pair indices ``t * k + j`` grouped by expert; the
    padding rows are never written nor read), ``block_expert`` [max_blocks], ``expert_start`` and
    ``expert_count`` [E] (each group's first row and its number of pairs), ``pair_rank`` [T * k]
    (each pair's row inside its group).
    """
    pairs = num_tokens * top_k
    blocks = max_blocks(pairs, num_experts, block_m)
    return {"sorted_pairs": (blocks * block_m,), "block_expert": (blocks,), "expert_start": (num_experts,),
            "expert_count": (num_experts,), "pair_rank": (pairs,)}


@dataclass(frozen=True)
class MoEConfig:
    """Meta-parameters of one MoE call (see :func:`choose_config`)."""

    block_m: int
    gate_up_block_n: int
    gate_up_block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int
    num_stages: int
    direct: bool = False
    """Decode path (:data:`DIRECT_MAX_PAIRS`): no alignment, one program per (pair, N tile) for the
    gate/up projection and per (token, N tile) for the down projection, which sums the token's
    k slots itself; ``block_m`` is then unused."""


ROUTE_IN_ROUTER_ENV = "GRAPHSERVING_MOE_ROUTE_IN_ROUTER"
ROUTE_IN_ROUTER = os.environ.get(ROUTE_IN_ROUTER_ENV, "0")
"""``GRAPHSERVING_MOE_ROUTE_IN_ROUTER`` as read at import (warmup, capture and replay agree): ``1`` routes
in the router projection's kernel where the model runs the router on the skinny GEMM
(``skinny_gemm.fused_add_rms_norm_gemv_route``: one kernel fewer per MoE layer), ``0`` (the default
until measured on a GPU) keeps :func:`fused_route_topk` a kernel of its own."""


def use_route_in_router() -> bool:
    """Whether the model routes inside the router projection's kernel (:data:`ROUTE_IN_ROUTER`).

    Raises:
        ValueError: ``GRAPHSERVING_MOE_ROUTE_IN_ROUTER`` set to anything but ``0`` or ``1``.
    """
    if ROUTE_IN_ROUTER not in ("0", "1"):
        raise ValueError(f"{ROUTE_IN_ROUTER_ENV}={ROUTE_IN_ROUTER!r}: expected 0 or 1")
    return ROUTE_IN_ROUTER == "1"


DIRECT_MAX_PAIRS = 32
"""Most (token, slot) pairs the direct decode path takes (T = 1..4 at k = 8). With a few pairs per
expert the alignment's M-blocks hold one real row of 16 (tensor-core tiles wasted) and its two
kernels plus the slot sum are three more graph nodes per layer; the direct path is three kernels
less and streams each chosen expert's weights as a matrix-vector product
(``bench/moe_bench.py --sweep``, bench/RESULTS.md)."""


DIRECT_GATE_UP_TILE = (2, 2048)
"""(output rows, K columns per iteration) of the direct gate/up kernel's programs: two gate and two
up rows, the whole hidden size (Qwen3-30B-A3B: 2048) in one round of loads."""
DIRECT_DOWN_TILE = (1, 1024)
"""(output rows, K columns per iteration) of the direct down kernel's programs, each of which loads
the token's k slots together (a [k, rows, K] tile): the whole expert width I at once
(Qwen3-30B-A3B: 768 of 1024), so a program's weights are one round of loads."""
DIRECT_STAGES = 1
"""Triton ``num_stages`` of the direct kernels (their loads feed no ``tl.dot``: no pipelining).

Tiles: the best of every combination of :data:`DIRECT_GATE_UP_TILE` rows 2-16 x K 256-2048,
:data:`DIRECT_DOWN_TILE` rows 1-4, 4 or 8 warps (``bench/moe_bench.py --batch-sizes 1 --grid``, E=128,
k=8, H=2048, I=768, bf16, an H100, 2026-12-06): 31.0 us per layer at T=1 against 33.7 for the
tiles of a coordinate sweep (16 x 256 gate/up), which had never paired narrow rows with a whole-K
tile; the layer 35.9 -> 31.1 us at T=1 and 61.5 -> 53.1 at T=2 against the previous kernels and tiles
(bench/RESULTS.md, "Fewer kernels per MoE layer")."""


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  element_size: int = 2) -> MoEConfig:
    """Meta-parameters from shapes only (warmup, capture and replay of a size agree).

    ``mean_rows = T*k / min(E, T*k)`` is the pairs of a routed expert under uniform routing.

    - ``block_m``: ``2 * mean_rows`` rounded up to a power of two, 16..64, so that most experts
      are one M-block and their weights are read once (T=1..128 at E=128, k=8: 16, the smallest
      ``tl.dot`` tile; T=256: 32; T>=512: 64). An expert with more pairs takes more blocks.
    - ``block_m`` 16 (decode: memory-bound, a few rows against whole weight matrices): narrow
      output tiles and K tiles of 128, so that many programs stream weights at once (T=1, k=8 on
      Qwen3-30B-A3B: 8 blocks x 24 gate/up tiles of 2 x 32 rows, 8 x 32 down tiles of 64 rows);
    - up to 64 mean rows: gate/up 64 x 64, down 128 x 64; prefill (more): gate/up 128 x 64 (two
      accumulators), down 256 x 64, for the tensor cores' arithmetic intensity;
    - ``num_stages``: as many K tiles in flight as :data:`SHARED_MEMORY_BUDGET` holds, 2..4.
    - at most :data:`DIRECT_MAX_PAIRS` pairs: the direct path with :data:`DIRECT_GATE_UP_TILE`
      and :data:`DIRECT_DOWN_TILE` (T=1, k=8 on Qwen3-30B-A3B: 8 x 384 gate/up programs, 2048 down
      programs).

    Tiles from a coordinate sweep on an H200 (``bench/moe_bench.py --sweep``; E=128, k=8, H=2048,
    I=768, bfloat16; 2026-12-01): at T=1 and 64 no neighbour of the decode tiles was faster; at
    T=512 the middle tiles took 437 us against 458 for 32-row blocks; at T=8192 the prefill tiles
    1902 us against 2376 for 64 x 64 ones.
    """
    pairs = max(1, num_tokens * top_k)
    if pairs <= DIRECT_MAX_PAIRS:
        return MoEConfig(16, DIRECT_GATE_UP_TILE[0], min(DIRECT_GATE_UP_TILE[1], next_power_of_2(hidden)),
                         DIRECT_DOWN_TILE[0], min(DIRECT_DOWN_TILE[1], next_power_of_2(inter)), num_warps=4,
                         num_stages=DIRECT_STAGES, direct=True)
    mean_rows = -(-pairs // min(num_experts, pairs))
    block_m = min(64, max(16, next_power_of_2(2 * mean_rows)))
    hidden_k = max(16, min(128, next_power_of_2(hidden)))
    inter_k = max(16, min(128, next_power_of_2(inter)))
    if block_m == 16:
        gate_up_n, gate_up_k, down_n, down_k, max_stages = 32, hidden_k, 64, inter_k, 4
    elif mean_rows < 64:
        gate_up_n, gate_up_k, down_n, down_k, max_stages = 64, min(64, hidden_k), 128, min(64, inter_k), 3
    else:
        gate_up_n, gate_up_k, down_n, down_k, max_stages = 128, min(64, hidden_k), 256, min(64, inter_k), 4
    stage_bytes = max((block_m + 2 * gate_up_n) * gate_up_k, (block_m + down_n) * down_k) * element_size
    num_stages = max(2, min(max_stages, SHARED_MEMORY_BUDGET // stage_bytes))
    return MoEConfig(block_m, gate_up_n, gate_up_k, down_n, down_k, num_warps=4, num_stages=num_stages)


# ---------------------------------------------------------------------- routing

@device_function
def route_topk_row(logits, real, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr):
    """One token's routing from its router logits ``logits`` float32 [BLOCK_E] (padding columns
    -inf): float32 softmax, top-k by k rounds of arg-max, optional renormalisation; ``real`` False
    (a padding row) gives every slot id E (the sentinel) and weight 0. Returns ``(weights float32
    [BLOCK_K], ids int32 [BLOCK_K])``; slots past ``TOP_K`` hold 0 and are never stored."""
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < NUM_EXPERTS
    p = tl.exp(logits - tl.max(logits, axis=0))
    probs = p / tl.sum(p, axis=0)
    # k rounds of arg-max, each one reduction over one int64 key per expert: the probability's
    # bits above (a float32 >= 0 orders as its bits do) and BLOCK_E - 1 - expert below, so the
    # largest key is the largest probability and, among equal ones, the lowest expert; taken
    # experts and padding columns hold -1, below every key.
    keys = tl.where(e_mask, (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - experts), -1)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        chosen = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        weights = tl.where(slots == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), weights)
        ids = tl.where(slots == j, chosen, ids)
        keys = tl.where(experts == chosen, -1, keys)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    return tl.where(real, weights, 0.0), tl.where(real, ids, NUM_EXPERTS)


@device_function
def route_in_last_program(logits_ptr, ticket_ptr, slots_ptr, weights_ptr, ids_ptr, num_rows, stride_lm,
                           NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                           TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
                           HAS_SLOTS: tl.constexpr):
    """An MoE router's top-k routing (:func:`route_topk_row`) in the program that stores the last
    column block of logits: every program takes a ticket once its logits are stored (a CTA barrier,
    then an acquire-release atomic add at device scope), and the one that draws the last ticket
    reads every row's logits from L2 (``.cg``: not from its own L1), routes them, and sets the
    ticket back to 0 for the next call (the kernel after this one starts only once every program has
    exited: the stream order, or its PDL wait)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        experts = tl.arange(0, BLOCK_E)
        slots = tl.arange(0, BLOCK_K)
        for row in tl.static_range(BLOCK_M):
            if row < num_rows:
                logits = tl.load(logits_ptr + row * stride_lm + experts, mask=experts < NUM_EXPERTS,
                                 other=float("-inf"), cache_modifier=".cg").to(tl.float32)
                real = True
                if HAS_SLOTS:  # a negative KV slot marks a padding row
                    real = tl.load(slots_ptr + row) >= 0
                weights, ids = route_topk_row(logits, real, NUM_EXPERTS, BLOCK_E, TOP_K, BLOCK_K, NORMALIZE)
                tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
                tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)
        tl.store(ticket_ptr, 0)


def _route_kernel(
    logits_ptr, slots_ptr, weights_ptr, ids_ptr, stride_l,
    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_SLOTS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=experts < NUM_EXPERTS,
                     other=float("-inf")).to(tl.float32)
    real = True
    if HAS_SLOTS:  # a negative KV slot marks a padding row
        real = tl.load(slots_ptr + row) >= 0
    weights, ids = route_topk_row(logits, real, NUM_EXPERTS, BLOCK_E, TOP_K, BLOCK_K, NORMALIZE)
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


_ROUTE = DeviceKernel(_route_kernel, pdl=True)


def fused_route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool,
                     slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.route_topk`` in one kernel: returns (weights float32 [T, k], ids int32 [T, k]).

    Same contract as ``graphserving.runtime.model.moe.route_topk`` (which checks the arguments and
    calls this on CUDA). Among equal probabilities the lowest expert index wins.
    """
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    _ROUTE.on(logits.device, tokens=num_tokens)[(num_tokens,)](
        logits, logits if slot_mapping is None else slot_mapping, weights, ids, logits.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_E=next_power_of_2(num_experts), TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k), NORMALIZE=normalize, HAS_SLOTS=slot_mapping is not None,
        num_warps=1 if num_experts <= 256 else 4,
    )
    return weights, ids


# ---------------------------------------------------------------------- alignment

def _rank_kernel(ids_ptr, pair_rank_ptr, expert_count_ptr, num_pairs, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    # Program e: the pairs that chose expert e, numbered in pair order (a prefix sum), and their count.
    pdl_enter(USE_PDL)
    expert = tl.program_id(0)
    seen = 0
    for first in range(0, num_pairs, BLOCK_N):
        pairs = first + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - hit
        tl.store(pair_rank_ptr + pairs, rank, mask=hit != 0)
        seen += tl.sum(hit, axis=0)
    tl.store(expert_count_ptr + expert, seen)


def _place_kernel(ids_ptr, pair_rank_ptr, sorted_pairs_ptr, block_expert_ptr, expert_start_ptr, expert_count_ptr,
                  num_pairs, num_blocks,
                  NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr):
    # Every program derives the padded group starts from the counts (E values); program 0 also
    # writes them and the expert of every M-block; each program places its chunk of pairs.
    pdl_enter(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < NUM_EXPERTS
    counts = tl.load(expert_count_ptr + experts, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    program = tl.program_id(0)
    if program == 0:
        tl.store(expert_start_ptr + experts, start, mask=e_mask)
        # Block b's expert is the number of groups that end at or before its first row (E past the total).
        for first in range(0, num_blocks, BLOCK_B):
            blocks = first + tl.arange(0, BLOCK_B)
            ended = (end[None, :] <= (blocks * BLOCK_M)[:, None]) & e_mask[None, :]
            tl.store(block_expert_ptr + blocks, tl.sum(ended.to(tl.int32), axis=1), mask=blocks < num_blocks)
    pairs = program * BLOCK_N + tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    routed = (ids >= 0) & (ids < NUM_EXPERTS)
    rank = tl.load(pair_rank_ptr + pairs, mask=routed, other=0)
    group_start = tl.gather(start, tl.where(routed, ids, 0), axis=0)
    tl.store(sorted_pairs_ptr + group_start + rank, pairs, mask=routed)


# Pair and block counts change with T; generic, they keep one compiled variant per chunk size.
_RANK = DeviceKernel(_rank_kernel, pdl=True, do_not_specialize=["num_pairs"])
_PLACE = DeviceKernel(_place_kernel, pdl=True, do_not_specialize=["num_pairs", "num_blocks"])


@dataclass(frozen=True)
class AlignedPairs:
    """The pairs grouped by expert (int32 device tensors; shapes :func:`align_buffer_shapes`)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    expert_start: torch.Tensor
    expert_count: torch.Tensor
    pair_rank: torch.Tensor


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Group the pairs ``t * k + j`` of ``topk_ids`` [T, k] (int32, contiguous) by expert, each
    group padded to a multiple of ``block_m`` rows (module docstring, step 2). Ids outside
    ``[0, E)`` (the sentinel E) route nowhere. Two kernels, no host synchronisation, fixed shapes."""
    num_tokens, top_k = topk_ids.shape
    shapes = align_buffer_shapes(num_tokens, top_k, num_experts, block_m)
    device = topk_ids.device
    aligned = AlignedPairs(**{name: torch.empty(shape, dtype=torch.int32, device=device)
                              for name, shape in shapes.items()})
    num_pairs, num_blocks = num_tokens * top_k, shapes["block_expert"][0]
    if num_pairs == 0:
        return aligned
    block_n = min(ALIGN_CHUNK, max(16, next_power_of_2(num_pairs)))
    block_e = next_power_of_2(num_experts)
    _RANK.on(device, tokens=num_tokens)[(num_experts,)](
        topk_ids, aligned.pair_rank, aligned.expert_count, num_pairs, BLOCK_N=block_n, num_warps=4,
    )
    _PLACE.on(device, tokens=num_tokens)[(-(-num_pairs // block_n),)](
        topk_ids, aligned.pair_rank, aligned.sorted_pairs, aligned.block_expert, aligned.expert_start,
        aligned.expert_count, num_pairs, num_blocks,
        NUM_EXPERTS=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_B=min(max(16, 8192 // block_e), max(16, next_power_of_2(num_blocks))), num_warps=4,
    )
    return aligned


# ---------------------------------------------------------------------- grouped GEMMs

@device_function
def _block_rows(block_m_index, expert, sorted_pairs_ptr, expert_start_ptr, expert_count_ptr, BLOCK_M: tl.constexpr):
    """The pair of each row of an M-block and whether the row holds one (padding rows do not)."""
    rows = block_m_index * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.load(expert_start_ptr + expert)
    count = tl.load(expert_count_ptr + expert)
    valid = rows - start < count
    pairs = tl.load(sorted_pairs_ptr + rows, mask=valid, other=0).to(tl.int64)
    return pairs, valid


@device_function
def _dot(a, b, acc, IEEE_FP32: tl.constexpr):
    """``acc + a @ b.T`` in float32 (IEEE for float32 operands and in the interpreter)."""
    if IEEE_FP32:
        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr, expert_start_ptr, expert_count_ptr,
    stride_xt, stride_we, stride_wn, stride_ap,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE_FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:  # past the padded total: this routing needs fewer blocks
        return
    pairs, valid = _block_rows(block, expert, sorted_pairs_ptr, expert_start_ptr, expert_count_ptr, BLOCK_M)
    tokens = pairs // TOP_K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < INTER
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_expert + n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_expert + (n + INTER).to(tl.int64)[:, None] * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < HIDDEN
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + cols[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_gate = _dot(x, tl.load(gate_rows + cols[None, :], mask=w_mask, other=0.0), acc_gate, IEEE_FP32)
        acc_up = _dot(x, tl.load(up_rows + cols[None, :], mask=w_mask, other=0.0), acc_up, IEEE_FP32)
    # Round gate and up as the projection's output would be, then F.silu(gate) * up.
    act_dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(act_dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(act_dtype)
    act = activated.to(tl.float32) * acc_up.to(act_dtype).to(tl.float32)
    tl.store(act_ptr + pairs[:, None] * stride_ap + n[None, :], act.to(act_dtype),
             mask=valid[:, None] & n_mask[None, :])


def _down_kernel(
    act_ptr, w_ptr, weights_ptr, y_ptr, sorted_pairs_ptr, block_expert_ptr, expert_start_ptr, expert_count_ptr,
    stride_ap, stride_we, stride_wn, stride_yp,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE_FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    pairs, valid = _block_rows(block, expert, sorted_pairs_ptr, expert_start_ptr, expert_count_ptr, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < HIDDEN
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < INTER
        a = tl.load(act_ptr + pairs[:, None] * stride_ap + cols[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        acc = _dot(a, tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0), acc,
                   IEEE_FP32)
    # The projection rounded, times the routing weight rounded to the activation dtype, rounded.
    y_dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(y_dtype).to(tl.float32)
    y = acc.to(y_dtype).to(tl.float32) * weight[:, None]
    tl.store(y_ptr + pairs[:, None] * stride_yp + n[None, :], y.to(y_dtype), mask=valid[:, None] & n_mask[None, :])


def _sum_slots_kernel(y_ptr, ids_ptr, out_ptr, stride_yp, stride_ot,
                      HIDDEN: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_H: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair)
        routed = (expert >= 0) & (expert < NUM_EXPERTS)  # a sentinel slot's row was never written
        width = tl.where(routed, HIDDEN, 0)
        acc += tl.load(y_ptr + pair * stride_yp + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


_GATE_UP = DeviceKernel(_gate_up_kernel, pdl=True)
_DOWN = DeviceKernel(_down_kernel, pdl=True)
_SUM_SLOTS = DeviceKernel(_sum_slots_kernel, pdl=True)

SUM_BLOCK_H = 1024
"""Columns per program of the slot sum (it reads k rows of ``H`` and writes one)."""


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, config: MoEConfig | None = None) -> torch.Tensor:
    """``moe.moe_experts`` with the Triton kernels (module docstring): returns [T, H] in ``x.dtype``.

    Same contract as ``graphserving.runtime.model.moe.moe_experts``, which checks the arguments and
    calls this on CUDA: x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I] (all of x's dtype, last
    dimension contiguous); topk_weights float32 [T, k]; topk_ids int32 [T, k], id E = no expert.
    ``config`` overrides :func:`choose_config` (benchmarks, tests); ``config.direct`` takes the
    direct decode path (module docstring) at any T.
    """
    num_tokens, hidden = x.shape
    num_experts, _, inter = w_down.shape
    top_k = topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    cfg = config or choose_config(num_tokens, top_k, num_experts, hidden, inter, x.element_size())
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.contiguous()
    if cfg.direct:
        return fused_moe_direct(x, w_gate_up, w_down, topk_weights, topk_ids, cfg, out)
    aligned = align_pairs(topk_ids, num_experts, cfg.block_m)
    blocks = aligned.block_expert.shape[0]
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    tables = (aligned.sorted_pairs, aligned.block_expert, aligned.expert_start, aligned.expert_count)
    launcher = _GATE_UP.on(x.device, tokens=num_tokens)
    # The interpreter cannot run tl.dot on bfloat16; float32 inputs must not round to TF32.
    ieee = DeviceKernel.is_interpreted(launcher) or x.dtype == torch.float32
    launcher[(blocks, -(-inter // cfg.gate_up_block_n))](
        x, w_gate_up, act, *tables, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, NUM_EXPERTS=num_experts, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, IEEE_FP32=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _DOWN.on(x.device, tokens=num_tokens)[(blocks, -(-hidden // cfg.down_block_n))](
        act, w_down, topk_weights, y, *tables, act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, IEEE_FP32=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    block_h = min(SUM_BLOCK_H, next_power_of_2(hidden))
    _SUM_SLOTS.on(x.device, tokens=num_tokens)[(num_tokens, -(-hidden // block_h))](
        y, topk_ids, out, y.stride(0), out.stride(0),
        HIDDEN=hidden, TOP_K=top_k, NUM_EXPERTS=num_experts, BLOCK_H=block_h, num_warps=4,
    )
    return out
