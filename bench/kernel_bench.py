"""Kernel micro-benchmark: each fused Triton kernel against the pure-torch reference path.

Times what a CUDA-graph replay pays: every operation is captured ``--reps`` times into one CUDA
graph, the graph is replayed and the time per operation is the replay time divided by the
repetitions (so Python and launch overhead are excluded on both sides). Shapes are those of the
model presets (``graphserving.runtime.model.presets``), one decoder layer's worth:

- ``add_rms_norm``: ``x + residual`` then RMSNorm [B, H] vs ``kernels.fused_add_rms_norm``;
- ``rope_write_kv``: two ``apply_rope`` + ``write_kv`` vs ``kernels.rope_and_write_kv``;
- ``silu_and_mul``: ``F.silu(gate) * up`` [B, 2I] vs ``kernels.silu_and_mul``;
- ``norm_qkv``, ``norm_gate_up_silu``: the *unfused kernel path* (``kernels.fused_add_rms_norm``
  then cuBLAS ``F.linear``, then ``kernels.silu_and_mul`` for the MLP) in the ``torch us``
  column vs ``kernels.fused_add_rms_norm_linear`` (one kernel) in ``triton us``, with the
  residual add. The weight is cycled through enough distinct copies (``--weight-bytes``) that it
  comes from HBM, not from the 50 MB L2, as in a real decode step whose layers' weights do not
  fit there. ``note`` says what ``kernels.use_fused_norm_linear`` decides for the shape (the
  policy to tune) and the meta-parameters ``choose_config`` picked. ``--sweep`` also times a
  grid of meta-parameters per shape (rows ``norm_qkv*``/``norm_gate_up_silu*``: the best one,
  the whole grid in the JSON);
- ``gemv``: the skinny GEMM of decode batches (``kernels.fused_add_rms_norm_gemv`` / ``kernels.gemv``,
  PDL kernels) against what it replaces (``kernels.fused_add_rms_norm`` + cuBLAS ``F.linear`` [+
  ``kernels.silu_and_mul``], or cuBLAS alone for O, down and the LM head with its float32 cast),
  weights cycled from HBM as for ``norm_linear``; ``note`` says what ``kernels.use_gemv`` decides
  and the meta-parameters; ``GB/s`` is the weight bytes over the kernel's time. ``--sweep``
  times a grid of meta-parameters (rows ``*``: the best);
- ``decode_attention``: ``attention.decode_attention`` vs ``kernels.paged_decode_attention``, for
  each context length, through a block table as wide as ``--table-tokens`` (the static table of
  a FULL graph is as wide as max_model_len; unused entries name the null block). The reference
  gathers the whole table; the kernel reads only ``seq_len`` keys. ``kv_GBps`` is the K/V bytes
  the kernel must read (B x context x Hkv x D x 2 x dtype size) over its time.

Each row also reports the largest absolute difference between the two outputs.

Usage (on a CUDA machine; a minute or two on an H200):
    python bench/kernel_bench.py --json-out kernel_bench.json
    python bench/kernel_bench.py --models llama-3-8b --batch-sizes 1,8 --contexts 2048
    python bench/kernel_bench.py --only norm_linear --batch-sizes 1,8,64        # the policy's table
    python bench/kernel_bench.py --only norm_linear --models smollm2-135m --batch-sizes 1 --sweep
    python bench/kernel_bench.py --only gemv --batch-sizes 1,2,4,8 --sweep           # the skinny GEMM's crossover
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from graphserving.runtime.model import kernels
from graphserving.runtime.model.attention import decode_attention, write_kv
from graphserving.runtime.model.llama import apply_rope, rms_norm
from graphserving.runtime.model.presets import preset_config

BLOCK_SIZE = 16
DEVICE = "cuda"
GROUPS = ("layer_ops", "norm_linear", "gemv", "attention")
REFERENCE_BYTES_LIMIT = 24 << 30
"""Skip a reference attention whose whole-table gather would exceed this many bytes."""


def graph_time_us(fn, reps: int, iters: int = 10) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``reps`` calls."""
    fn()  # compile / initialise outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def row(model: str, kernel: str, batch: int, context: int | None, ref_us: float | None, fused_us: float,
        diff: float | None, **extra) -> dict:
    return dict(model=model, kernel=kernel, batch=batch, context=context, torch_us=ref_us, triton_us=fused_us,
                speedup=(ref_us / fused_us) if ref_us else None, max_abs_diff=diff, **extra)


def bench_layer_ops(name: str, batch: int, dtype: torch.dtype, reps: int) -> list[dict]:
    cfg = preset_config(name)
    hq, hkv, d, h, inter = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                            cfg.intermediate_size)
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(0)
    out: list[dict] = []

    x = torch.randn(batch, h, device=dev, dtype=dtype, generator=gen)
    residual = torch.randn(batch, h, device=dev, dtype=dtype, generator=gen)
    weight = torch.randn(h, device=dev, dtype=dtype, generator=gen)
    eps = cfg.rms_norm_eps
    ref = lambda: rms_norm(x + residual, weight, eps)  # noqa: E731
    fused = lambda: kernels.fused_add_rms_norm(x, residual, weight, eps)  # noqa: E731
    out.append(row(name, "add_rms_norm", batch, None, graph_time_us(ref, reps), graph_time_us(fused, reps),
                   max_diff(fused()[0], ref())))

    gate_up = torch.randn(batch, 2 * inter, device=dev, dtype=dtype, generator=gen)
    ref = lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # noqa: E731
    fused = lambda: kernels.silu_and_mul(gate_up)  # noqa: E731
    out.append(row(name, "silu_and_mul", batch, None, graph_time_us(ref, reps), graph_time_us(fused, reps),
                   max_diff(fused(), ref())))

    qkv = torch.randn(batch, (hq + 2 * hkv) * d, device=dev, dtype=dtype, generator=gen)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(batch, hq, d), k.view(batch, hkv, d), v.view(batch, hkv, d)
    max_pos = 4096
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.arange(max_pos, device=dev).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, max_pos, (batch,), device=dev, generator=gen)
    num_blocks = batch + 1
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, hkv, d, device=dev, dtype=dtype)
    slots = torch.arange(batch, device=dev) * BLOCK_SIZE + BLOCK_SIZE + 3

    def ref_rope():
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        q_rot, k_rot = apply_rope(q, c, s), apply_rope(k, c, s)
        write_kv(cache, k_rot, v, slots)
        return q_rot

    fused = lambda: kernels.rope_and_write_kv(q, k, v, positions, cos, sin, cache, slots)[0]  # noqa: E731
    out.append(row(name, "rope_write_kv", batch, None, graph_time_us(ref_rope, reps), graph_time_us(fused, reps),
                   max_diff(fused(), ref_rope())))
    return out


SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (64, 128)
SWEEP_STAGES = (2, 4, 8)


def sweep_configs(default, hidden: int) -> list:
    """A small grid of meta-parameters around ``default`` (a ``NormLinearConfig``) for ``--sweep``."""
    configs = [default]
    for block_n, block_k, stages in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_STAGES):
        cfg = dataclasses.replace(default, block_n=block_n, block_k=block_k, num_stages=stages,
                                  norm_unroll=min(-(-hidden // block_k), 16))
        if cfg not in configs:
            configs.append(cfg)
    return configs


class WeightCycle:
    """Distinct random copies of one ``[rows, cols]`` weight, handed out in turn, so that a graph of
    ``calls`` projections reads each copy once per replay from HBM, not from the 50 MB L2 (as a
    decode step does: its layers' weights do not fit there). ``weight_bytes`` of copies, 1-1024."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, weight_bytes: int,
                 reps: int) -> None:
        size = rows * cols * torch.empty((), dtype=dtype).element_size()
        self.copies = max(1, min(1024, -(-weight_bytes // size)))
        self.calls = max(reps, self.copies)  # each copy once per replay: nothing is left in L2 for the next
        self._weights = [torch.randn(rows, cols, device=DEVICE, dtype=dtype, generator=gen) * cols ** -0.5
                         for _ in range(self.copies)]
        self._turn = 0

    def next(self) -> torch.Tensor:
        self._turn += 1
        return self._weights[self._turn % self.copies]

    def rewind(self) -> None:
        """Start the cycle again (two paths compared on the same copy)."""
        self._turn = 0

    def clear(self) -> None:
        self._weights.clear()


def time_configs(configs: list, run, calls: int) -> tuple[list[dict], dict]:
    """``--sweep``: each config's ``graph_time_us`` of ``run(config)`` (a config that fails to
    compile or launch, e.g. a pipeline too deep for shared memory or out of registers, is recorded
    with its error); returns every timing and the fastest."""
    timings = []
    for candidate in configs:
        try:
            us = graph_time_us(lambda c=candidate: run(c), calls)
        except Exception as exc:
            timings.append(dict(config=dataclasses.asdict(candidate), us=None, error=type(exc).__name__))
            continue
        timings.append(dict(config=dataclasses.asdict(candidate), us=us))
    return timings, min((t for t in timings if t["us"] is not None), key=lambda t: t["us"])


def config_str(cfg) -> str:
    return (f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
            f"u{cfg.norm_unroll}")


def bench_norm_linear(name: str, batch: int, dtype: torch.dtype, reps: int, weight_bytes: int,
                      sweep: bool) -> list[dict]:
    """Fused norm + QKV and add + norm + gate/up + SwiGLU vs the unfused kernels, weights from HBM."""
    from graphserving.runtime.model.kernels.norm_linear import _target_programs, choose_config

    cfg = preset_config(name)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(2)
    eps = cfg.rms_norm_eps
    x = torch.randn(batch, h, device=dev, dtype=dtype, generator=gen)
    residual = torch.randn(batch, h, device=dev, dtype=dtype, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(h, device=dev, dtype=dtype, generator=gen)
    out: list[dict] = []
    for kernel, rows_out, activation in (("norm_qkv", qkv_rows, None),
                                         ("norm_gate_up_silu", 2 * inter, "silu_and_mul")):
        weights = WeightCycle(rows_out, h, dtype, gen, weight_bytes, reps)
        next_weight, calls = weights.next, weights.calls
        bias = torch.zeros(rows_out, device=dev, dtype=dtype) if cfg.attention_bias and not activation else None

        def unfused():
            normed, _ = kernels.fused_add_rms_norm(x, residual, norm_weight, eps)
            y = F.linear(normed, next_weight(), bias)
            return kernels.silu_and_mul(y) if activation else y

        def fused(config=None):
            return kernels.fused_add_rms_norm_linear(x, residual, norm_weight, next_weight(), bias, eps, activation,
                                                     config=config)[0]

        chosen = choose_config(batch, h, rows_out // 2 if activation else rows_out, activation is not None,
                               _target_programs(torch.device(dev)), x.element_size())
        ref_us, fused_us = graph_time_us(unfused, calls), graph_time_us(fused, calls)
        weights.rewind()
        fused_out = fused()
        weights.rewind()
        diff = max_diff(fused_out, unfused())
        policy = kernels.use_fused_norm_linear(batch, h, rows_out)
        out.append(row(name, kernel, batch, None, ref_us, fused_us, diff,
                       note=f"policy:{'fused' if policy else 'unfused'} {config_str(chosen)}",
                       policy_fuses=policy, config=dataclasses.asdict(chosen), weight_copies=weights.copies))
        if sweep:
            timings, best = time_configs(sweep_configs(chosen, h), fused, calls)
            out.append(row(name, kernel + "*", batch, None, ref_us, best["us"], None,
                           note=f"best of {len(timings)}: {config_str(type(chosen)(**best['config']))}",
                           config=best["config"], sweep=timings))
        weights.clear()
        torch.cuda.empty_cache()
    return out


GEMV_SWEEP = dict(block_n=(1, 2, 4, 8, 16), block_k=(64, 256, 1024, 2048), num_warps=(4, 8, 16))


def gemv_sweep_configs(default) -> list:
    """A grid of ``GemvConfig`` around ``default`` for ``--sweep`` (within the register budget)."""
    from graphserving.runtime.model.kernels.skinny_gemm import MAX_TILE_ELEMENTS

    configs = [default]
    for block_n, block_k, warps in itertools.product(*GEMV_SWEEP.values()):
        cfg = dataclasses.replace(default, block_n=block_n, block_k=block_k, num_warps=warps)
        if cfg not in configs and default.block_m * block_n * block_k <= 2 * MAX_TILE_ELEMENTS:
            configs.append(cfg)
    return configs


def bench_gemv(name: str, batch: int, dtype: torch.dtype, reps: int, weight_bytes: int, sweep: bool) -> list[dict]:
    """Each projection of a dense layer and the LM head: the skinny GEMM vs the kernels it replaces."""
    from graphserving.runtime.model.kernels.skinny_gemm import choose_config

    cfg = preset_config(name)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(3)
    eps = cfg.rms_norm_eps
    norm_weight = 1 + 0.1 * torch.randn(h, device=dev, dtype=dtype, generator=gen)
    out: list[dict] = []
    # (kernel, weight rows, weight columns, norm before it, SwiGLU after it, float32 out)
    projections = (("gemv_norm_qkv", qkv_rows, h, True, False, False),
                   ("gemv_o", h, cfg.num_attention_heads * cfg.head_dim, False, False, False),
                   ("gemv_norm_gate_up", 2 * inter, h, True, True, False),
                   ("gemv_down", h, inter, False, False, False),
                   ("gemv_lm_head", cfg.vocab_size, h, False, False, True))
    for kernel, rows_out, cols, norm, gated, logits in projections:
        x = torch.randn(batch, cols, device=dev, dtype=dtype, generator=gen)
        residual = torch.randn(batch, cols, device=dev, dtype=dtype, generator=gen)
        size = rows_out * cols * x.element_size()
        weights = WeightCycle(rows_out, cols, dtype, gen, weight_bytes, reps)
        next_weight, calls = weights.next, weights.calls

        def replaced():
            a = kernels.fused_add_rms_norm(x, residual, norm_weight, eps)[0] if norm else x
            y = F.linear(a, next_weight())
            return kernels.silu_and_mul(y) if gated else (y.float() if logits else y)

        def skinny(config=None):
            if norm:
                return kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, next_weight(), None, eps,
                                                       "silu_and_mul" if gated else None, config=config)[0]
            return kernels.gemv(x, next_weight(), out_dtype=torch.float32 if logits else None, config=config)

        chosen = choose_config(batch, cols, gated)
        ref_us, gemv_us = graph_time_us(replaced, calls), graph_time_us(skinny, calls)
        weights.rewind()
        got = skinny()
        weights.rewind()
        diff = max_diff(got, replaced())
        policy = kernels.use_gemv(batch, rows_out, cols, h, device=x.device, norm_only=kernel == "gemv_norm_qkv")
        out.append(row(name, kernel, batch, None, ref_us, gemv_us, diff, weight_GBps=size / (gemv_us * 1e-6) / 1e9,
                       note=f"policy:{'gemv' if policy else 'cuBLAS'} m{chosen.block_m} n{chosen.block_n} "
                            f"k{chosen.block_k} w{chosen.num_warps} a{chosen.ahead}",
                       policy_gemv=policy, config=dataclasses.asdict(chosen), weight_copies=weights.copies))
        if sweep:
            timings, best = time_configs(gemv_sweep_configs(chosen), skinny, calls)
            c = best["config"]
            out.append(row(name, kernel + "*", batch, None, ref_us, best["us"], None,
                           weight_GBps=size / (best["us"] * 1e-6) / 1e9,
                           note=f"best of {len(timings)}: m{c['block_m']} n{c['block_n']} k{c['block_k']} "
                                f"w{c['num_warps']}", config=c, sweep=timings))
        weights.clear()
        torch.cuda.empty_cache()
    return out


def bench_attention(name: str, batch: int, context: int, table_tokens: int, dtype: torch.dtype, reps: int,
                    num_splits: int | None = None, kv_bytes_cycled: int = 0, grid: dict | None = None) -> list[dict]:
    """``kernels.paged_decode_attention`` against the reference. With ``kv_bytes_cycled`` the calls
    of one graph read distinct blocks (block tables over that many bytes of keys and values, beyond
    the L2, as the layers of a decode step do); with ``grid`` (``block_n``, ``num_warps``,
    ``num_stages`` lists) each combination is timed too (rows ``decode_attention*``)."""
    from graphserving.runtime.model.kernels import decode_attention as attention_kernels

    cfg = preset_config(name)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(1)
    width = table_tokens // BLOCK_SIZE
    used = -(-context // BLOCK_SIZE)
    kv_bytes = batch * context * hkv * d * 2 * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(64, -(-kv_bytes_cycled // kv_bytes))) if kv_bytes_cycled else 1
    num_blocks = 1 + copies * batch * used
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, device=dev, dtype=dtype, generator=gen)
    # Scrambled, non-contiguous blocks per row (each copy its own); entries past the context name
    # the null block (0).
    blocks = (torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1).view(copies, batch, used).to(torch.int32)
    tables = [torch.zeros(batch, width, device=dev, dtype=torch.int32) for _ in range(copies)]
    for table, owned in zip(tables, blocks):
        table[:, :used] = owned
    seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype, generator=gen)
    scale = d ** -0.5
    turn = [0]

    def fused(block_n=None):
        turn[0] += 1
        return kernels.paged_decode_attention(q, k_cache, v_cache, tables[turn[0] % copies], seq_lens, scale,
                                              num_splits=num_splits, block_n=block_n)

    calls = max(reps, copies)
    fused_us = graph_time_us(fused, calls)
    block_table = tables[0]
    gather_bytes = 2 * batch * width * BLOCK_SIZE * hkv * d * k_cache.element_size()
    ref_us = diff = None
    if gather_bytes <= REFERENCE_BYTES_LIMIT and num_splits is None:  # the reference once per shape
        ref = lambda: decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)  # noqa: E731
        ref_us = graph_time_us(ref, max(1, min(reps, REFERENCE_BYTES_LIMIT // (8 * gather_bytes))))
        turn[0] = -1
        diff = max_diff(fused(), ref())
        torch.cuda.empty_cache()
    rows = [row(name, "decode_attention", batch, context, ref_us, fused_us, diff,
                kv_GBps=kv_bytes / (fused_us * 1e-6) / 1e9, table_tokens=table_tokens, kv_copies=copies,
                num_splits=num_splits, note=f"splits {'auto' if num_splits is None else num_splits}, "
                                            f"{attention_kernels.DECODE_LAUNCH}")]
    if grid:
        default = dict(attention_kernels.DECODE_LAUNCH)
        timings = []
        pipelines = [bool(p) for p in grid.get("PIPELINE", [default["PIPELINE"]])]
        for block_n, warps, stages, pipeline in itertools.product(grid["block_n"], grid["num_warps"],
                                                                  grid["num_stages"], pipelines):
            attention_kernels.DECODE_LAUNCH.update(num_warps=warps, num_stages=stages, PIPELINE=pipeline)
            config = dict(block_n=block_n, num_warps=warps, num_stages=stages, PIPELINE=pipeline)
            try:
                timings.append(dict(config=config, us=graph_time_us(lambda b=block_n: fused(b), calls)))
            except Exception as exc:  # out of shared memory or registers
                timings.append(dict(config=config, us=None, error=type(exc).__name__))
            finally:
                attention_kernels.DECODE_LAUNCH.update(default)
        for t in sorted((t for t in timings if t["us"] is not None), key=lambda t: t["us"])[:4]:
            rows.append(row(name, "decode_attention*", batch, context, None, t["us"], None,
                            kv_GBps=kv_bytes / (t["us"] * 1e-6) / 1e9, note=f"splits {num_splits or 'auto'}, "
                            + " ".join(f"{k}={v}" for k, v in t["config"].items()), sweep=timings))
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'model':<14}{'kernel':<20}{'batch':>6}{'context':>8}{'torch us':>11}{'triton us':>11}" \
             f"{'speedup':>9}{'GB/s':>9}{'max diff':>10}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        ctx = "" if r["context"] is None else str(r["context"])
        ref = "skipped" if r["torch_us"] is None else f"{r['torch_us']:.1f}"
        speed = "" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        gbps = f"{r['kv_GBps']:.0f}" if "kv_GBps" in r else f"{r['weight_GBps']:.0f}" if "weight_GBps" in r else ""
        diff = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2g}"
        print(f"{r['model']:<14}{r['kernel']:<20}{r['batch']:>6}{ctx:>8}{ref:>11}{r['triton_us']:>11.1f}"
              f"{speed:>9}{gbps:>9}{diff:>10}  {r.get('note', '')}")


def parse_grid(parser: argparse.ArgumentParser, flag: str, text: str, required: set[str],
               optional: set[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """A sweep grid ``'name=1,2;other=3'`` as ``{name: (1, 2), other: (3,)}``; a usage error (exit 2)
    unless it names every ``required`` parameter and nothing beyond ``optional``."""
    grid = {k: tuple(int(v) for v in values.split(","))
            for k, values in (part.split("=", 1) for part in text.split(";") if part)}
    if not required <= set(grid) <= required | optional:
        parser.error(f"{flag}: name {', '.join(sorted(required))}"
                     + (f" (and {', '.join(sorted(optional))} if wanted)" if optional else " and nothing else"))
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b,llama-3-8b")
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--table-tokens", type=int, default=8192, help="block-table width in tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=20, help="operations per captured graph")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups of rows to run, of {', '.join(GROUPS)}")
    parser.add_argument("--weight-bytes", type=int, default=256 << 20,
                        help="norm_linear rows cycle through this many bytes of distinct weights (beyond L2)")
    parser.add_argument("--sweep", action="store_true",
                        help="norm_linear and gemv rows: also time a grid of meta-parameters per shape (slow: compiles each)")
    parser.add_argument("--gemv-grid", default=None,
                        help="gemv --sweep: the grid instead of GEMV_SWEEP, e.g. 'block_n=2,4,8;block_k=2048;num_warps=4,8'")
    parser.add_argument("--attention-grid", default=None,
                        help="attention rows: also time each launch of this grid, e.g. "
                             "'block_n=32,64;num_warps=4,8;num_stages=1,2,3;PIPELINE=0,1' (the four best are printed)")
    parser.add_argument("--kv-bytes", type=int, default=256 << 20,
                        help="attention rows cycle through this many bytes of keys and values (beyond L2); 0: one copy")
    parser.add_argument("--splits", default="auto",
                        help="attention rows: comma-separated context split counts to time, 'auto' for the "
                             "kernel's own choice (e.g. auto,1,2,4: the split-count policy sweep)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    splits = [None if x == "auto" else int(x) for x in args.splits.split(",") if x]
    if args.gemv_grid:
        GEMV_SWEEP.update(parse_grid(parser, "--gemv-grid", args.gemv_grid, set(GEMV_SWEEP)))
    attention_grid = (parse_grid(parser, "--attention-grid", args.attention_grid,
                                 {"block_n", "num_warps", "num_stages"}, {"PIPELINE"})
                      if args.attention_grid else None)
    groups = [g for g in args.only.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"--only: unknown groups {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if not torch.cuda.is_available():
        print("kernel_bench needs CUDA", file=sys.stderr)
        return 2
    if not kernels.triton_importable():
        print("kernel_bench needs triton", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows: list[dict] = []
    with torch.inference_mode():
        for name in args.models.split(","):
            for batch in batches:
                if "layer_ops" in groups:
                    rows += bench_layer_ops(name, batch, dtype, args.reps)
                if "norm_linear" in groups:
                    rows += bench_norm_linear(name, batch, dtype, args.reps, args.weight_bytes, args.sweep)
                if "gemv" in groups and batch <= 8:
                    rows += bench_gemv(name, batch, dtype, args.reps, args.weight_bytes, args.sweep)
                if "attention" in groups:
                    for context in contexts:
                        for num_splits in splits:
                            rows += bench_attention(name, batch, context, args.table_tokens, dtype, args.reps,
                                                    num_splits, args.kv_bytes, attention_grid)
                torch.cuda.empty_cache()
    print_table(rows)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, dtype=args.dtype, block_size=BLOCK_SIZE, rows=rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
