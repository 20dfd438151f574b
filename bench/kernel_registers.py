"""Registers per thread of the skinny GEMM's compiled variants, and how many of its programs fit on
one multiprocessor: compiled for sm_90 offline (Triton's own ptxas; no GPU needed). With
``--attention``, the decode attention's context loop instead: registers, shared memory, programs per
multiprocessor and the copy waits (``DEPBAR.LE SB0, n``: n copy groups may stay in flight) of each
loop form and stage count. With ``--moe``, the direct MoE down kernel of each model's expert shape
over ``bench/moe_bench.py``'s grid of tiles: registers, programs per multiprocessor, SASS
instructions (a warp's dynamic count where the code has no loop), vector and scalar loads, whether a
loop is left, and warp instructions per KB of expert weights (the down kernel measured bound by
issuing instructions, not by bytes: bench/RESULTS.md).

Compile with the device's Triton (3.6.0: ``pip download triton==3.6.0`` and install it into a folder
on ``PYTHONPATH``); other releases compile the same kernel differently (Triton 3.9 gives the direct
down kernel 150 registers and scalar loads where 3.6 gives 80 and vector loads). The header says
which Triton compiled the table.

A batch-1 projection is bound by the weight bytes in flight, so a program too fat in registers to
share a multiprocessor halves what one can have in flight. For each projection of each model at
batch 1, the config ``choose_config`` picks is compiled as the runtime JIT would specialise it
(pointers and strides divisible by 16), ``cuobjdump -res-usage`` reads its registers and
``cuobjdump -sass`` its block-wide barriers.

Usage:
    python bench/kernel_registers.py --models llama-3.2-1b,smollm2-135m
    python bench/kernel_registers.py --attention --models llama-3-8b,llama-3.2-1b
    PYTHONPATH=/path/to/triton-3.6 python bench/kernel_registers.py --moe --models qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from graphserving.runtime.model.kernels import decode_attention, moe_direct, skinny_gemm
from graphserving.runtime.model.kernels.backend import next_power_of_2
from graphserving.runtime.model.presets import preset_config

REGISTERS_PER_SM = 65536
"""Hopper: 64K 32-bit registers per multiprocessor (allocated per warp in units of 256)."""
SHARED_PER_SM = 228 * 1024
"""Hopper: shared memory per multiprocessor, 1 KiB of it reserved per resident program."""


def compile_sm90(fn, signature: dict, constants: dict, num_warps: int, num_stages: int = 1) -> tuple[int, int, str]:
    """``fn`` compiled for sm_90 as the runtime JIT would specialise it (pointers and strides divisible
    by 16): (registers per thread, shared memory bytes, SASS)."""
    signature = signature | {name: "constexpr" for name in constants}
    names = list(signature)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n.startswith("stride_")}
    source = ASTSource(triton.jit(fn), signature, constexprs=constants, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), compiled.metadata.shared, sass


def programs_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Resident programs per multiprocessor allowed by registers and shared memory."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(REGISTERS_PER_SM // (per_warp * num_warps), SHARED_PER_SM // (shared + 1024))


def compile_registers(hidden: int, out_cols: int, norm: bool, gated: bool, router: bool = False,
                      route_top_k: int = 0) -> tuple[skinny_gemm.GemvConfig, int, int]:
    """The config of a batch-1 projection ``[out_cols, hidden]``, its registers per thread on sm_90 and
    the block-wide barriers (``BAR.SYNC``) in its machine code: each one a point where every warp of
    the program waits (a reduction across warps, or a tile copied through shared memory into another
    layout). ``router``: an MoE router's (the normed rows stored for the experts); ``route_top_k``: with
    the routing in its last program (``skinny_gemm.fused_add_rms_norm_gemv_route``, padding rows by slot)."""
    cfg = skinny_gemm.choose_config(1, hidden, gated)
    pointers = ["x_ptr", "residual_ptr", "norm_weight_ptr", "weight_ptr", "bias_ptr", "out_ptr", "residual_out_ptr",
                "normed_out_ptr"]
    signature = {name: "*bf16" for name in pointers}
    signature |= {"route_ticket_ptr": "*i32", "route_slots_ptr": "*i64", "route_weights_ptr": "*fp32",
                  "route_ids_ptr": "*i32", "num_rows": "i32", "eps": "fp32"}
    signature |= {name: "i32" for name in ("stride_xm", "stride_rm", "stride_wn", "stride_om", "stride_rom", "stride_nm")}
    constants = dict(HIDDEN=hidden, OUT_COLS=out_cols, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     NORM=norm, HAS_RESIDUAL=norm, HAS_BIAS=False, SILU_AND_MUL=gated, STORE_NORMED=router,
                     AHEAD=cfg.ahead, ROUTE_TOP_K=route_top_k, ROUTE_BLOCK_E=next_power_of_2(out_cols),
                     ROUTE_BLOCK_K=next_power_of_2(max(1, route_top_k)), ROUTE_NORMALIZE=route_top_k > 0,
                     ROUTE_HAS_SLOTS=route_top_k > 0, USE_PDL=True)
    regs, _, sass = compile_sm90(skinny_gemm._gemv_kernel, signature, constants, cfg.num_warps)
    return cfg, regs, len(re.findall(r"\bBAR\.SYNC\b", sass))


def attention_table(models: list[str]) -> None:
    """The decode kernel of each model's shape (bfloat16, blocks of 16, tiles of ``BLOCK_N``, one split,
    no RoPE, no prefetch: the batch-64 case), per loop form and stage count."""
    signature = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_table_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                 "scale_log2": "fp32", "num_splits": "i32"}
    signature |= {n: "i32" for n in ("stride_qn", "stride_qh", "stride_on", "stride_oh", "stride_kb", "stride_kt",
                                     "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_btn")}
    signature |= {"k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "positions_ptr": "*i64", "cos_ptr": "*fp32",
                  "sin_ptr": "*fp32", "slot_mapping_ptr": "*i64"}
    signature |= {n: "i32" for n in ("stride_kn", "stride_knh", "stride_vn", "stride_vnh", "stride_cos", "stride_sin")}
    print("| model | loop | stages | registers | shared bytes | programs per SM | copy waits |")
    print("|---|---|---:|---:|---:|---:|---|")
    warps = decode_attention.DECODE_LAUNCH["num_warps"]
    for name in models:
        c = preset_config(name)
        group = c.num_attention_heads // c.num_key_value_heads
        for pipeline in (False, True):
            for stages in (2, 3, 4):
                constants = dict(NUM_HEADS=c.num_attention_heads, GROUP=group, BLOCK_G=max(16, group),
                                 HEAD_DIM=c.head_dim, BLOCK_D=c.head_dim, BLOCK_SIZE=16, BLOCK_N=decode_attention.BLOCK_N,
                                 MAX_SPLITS=decode_attention.MAX_SPLITS, UPCAST=False, DIRECT=True, ROPE=False,
                                 PREFETCH=False, NULL_SLOT=0, USE_PDL=False, PIPELINE=pipeline)
                regs, shared, sass = compile_sm90(decode_attention._paged_decode_kernel, signature, constants, warps, stages)
                waits = ", ".join(sorted(set(re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", sass))))
                print(f"| {name} | {'explicit prefetch' if pipeline else 'plain'} | {stages} | {regs} | {shared} | "
                      f"{programs_per_sm(regs, shared, warps)} | {waits} |")


def _branches_back(sass_line: str) -> bool:
    """Whether a SASS line is a branch to an earlier address (a loop; the trap's branch to itself after
    the last ``EXIT`` is not one)."""
    found = re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA (0x[0-9a-f]+)", sass_line)
    return found is not None and int(found.group(2), 16) < int(found.group(1), 16)


def moe_table(models: list[str]) -> None:
    """The direct MoE down kernel (one token, bfloat16) of each model's expert shape, per tile of
    ``moe_bench.GRID`` (rows x K tile x warps)."""
    from moe_bench import GRID

    signature = {"act_ptr": "*bf16", "w_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                 "stride_ap": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_ot": "i32"}
    print(f"Triton {triton.__version__}")
    print("| model | rows x K tile, warps | registers | programs per SM | SASS instructions | vector / scalar loads "
          "| loop left | warp instructions per KB |")
    print("|---|---|---:|---:|---:|---|---|---:|")
    for name in models:
        c = preset_config(name)
        inter, top_k = c.moe_intermediate_size, c.num_experts_per_tok
        for rows in GRID["down_block_n"]:
            for block_k in GRID["down_block_k"]:
                for warps in GRID["num_warps"]:
                    constants = dict(HIDDEN=c.hidden_size, INTER=inter, TOP_K=top_k, NUM_EXPERTS=c.num_experts,
                                     BLOCK_N=rows, BLOCK_K=block_k, BLOCK_S=next_power_of_2(top_k),
                                     USE_PDL=True)
                    regs, shared, sass = compile_sm90(moe_direct._down_direct_kernel, signature, constants, warps)
                    code = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
                    vector = sum("LDG.E.128" in line for line in code)
                    scalar = sum("LDG" in line for line in code) - vector
                    looped = any(_branches_back(line) for line in code)
                    per_kb = len(code) * warps / (rows * inter * top_k * 2 / 1024)
                    print(f"| {name} | {rows} x {block_k}, {warps} | {regs} | {programs_per_sm(regs, shared, warps)} | "
                          f"{len(code)} | {vector} / {scalar} | {'yes' if looped else 'no'} | {per_kb:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--attention", action="store_true", help="the decode attention's context loop instead")
    parser.add_argument("--moe", action="store_true", help="the direct MoE down kernel's tiles instead")
    args = parser.parse_args()
    if args.attention:
        attention_table(args.models.split(","))
        return
    if args.moe:
        moe_table(args.models.split(","))
        return
    print("| model | projection | config (m, n, k, warps) | registers | programs per SM (registers) | barriers |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.models.split(","):
        c = preset_config(name)
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        routers = [] if not c.num_experts else [
            ("add + norm + router", c.hidden_size, c.num_experts, True, False, True, 0),
            (f"add + norm + router + top {c.num_experts_per_tok}", c.hidden_size, c.num_experts, True, False, True,
             c.num_experts_per_tok)]
        for label, hidden, out_cols, norm, gated, router, top_k in (
                ("norm + QKV", c.hidden_size, qkv, True, False, False, 0),
                ("add + norm + gate/up + SwiGLU", c.hidden_size, c.intermediate_size, True, True, False, 0),
                ("down", c.intermediate_size, c.hidden_size, False, False, False, 0), *routers):
            cfg, regs, barriers = compile_registers(hidden, out_cols, norm, gated, router, top_k)
            fits = programs_per_sm(regs, 0, cfg.num_warps)
            print(f"| {name} | {label} | {cfg.block_m}, {cfg.block_n}, {cfg.block_k}, {cfg.num_warps} | {regs} | {fits} | {barriers} |")


if __name__ == "__main__":
    main()
