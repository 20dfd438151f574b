"""Registers per thread of the skinny GEMM's compiled variants, and how many of its programs fit on
one multiprocessor: compiled for sm_90 offline (Triton's own ptxas; no GPU needed).

A batch-1 projection is bound by the weight bytes in flight, so a program too fat in registers to
share a multiprocessor halves what one can have in flight. For each projection of each model at
batch 1, the config ``choose_config`` picks is compiled as the runtime JIT would specialise it
(pointers and strides divisible by 16), ``cuobjdump -res-usage`` reads its registers and
``cuobjdump -sass`` its block-wide barriers.

Usage:
    python bench/kernel_registers.py --models llama-3.2-1b,smollm2-135m
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

from graphserving.runtime.model.kernels import skinny_gemm
from graphserving.runtime.model.presets import preset_config

REGISTERS_PER_SM = 65536
"""Hopper: 64K 32-bit registers per multiprocessor (allocated per warp in units of 256)."""


def compile_registers(hidden: int, out_cols: int, norm: bool, gated: bool) -> tuple[skinny_gemm.GemvConfig, int, int]:
    """The config of a batch-1 projection ``[out_cols, hidden]``, its registers per thread on sm_90 and
    the block-wide barriers (``BAR.SYNC``) in its machine code: each one a point where every warp of
    the program waits (a reduction across warps, or a tile copied through shared memory into another
    layout)."""
    cfg = skinny_gemm.choose_config(1, hidden, gated)
    pointers = ["x_ptr", "residual_ptr", "norm_weight_ptr", "weight_ptr", "bias_ptr", "out_ptr", "residual_out_ptr",
                "normed_out_ptr"]
    signature = {name: "*bf16" for name in pointers} | {"num_rows": "i32", "eps": "fp32"}
    signature |= {name: "i32" for name in ("stride_xm", "stride_rm", "stride_wn", "stride_om", "stride_rom", "stride_nm")}
    constants = dict(HIDDEN=hidden, OUT_COLS=out_cols, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     NORM=norm, HAS_RESIDUAL=norm, HAS_BIAS=False, SILU_AND_MUL=gated, STORE_NORMED=False, USE_PDL=True)
    signature |= {name: "constexpr" for name in constants}
    names = list(signature)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n.startswith("stride_")}
    source = ASTSource(triton.jit(skinny_gemm._gemv_kernel), signature, constexprs=constants, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    return cfg, int(re.search(r"REG:(\d+)", usage).group(1)), len(re.findall(r"\bBAR\.SYNC\b", sass))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    args = parser.parse_args()
    print("| model | projection | config (m, n, k, warps) | registers | programs per SM (registers) | barriers |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.models.split(","):
        c = preset_config(name)
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        for label, hidden, out_cols, norm, gated in (
                ("norm + QKV", c.hidden_size, qkv, True, False),
                ("add + norm + gate/up + SwiGLU", c.hidden_size, c.intermediate_size, True, True),
                ("down", c.intermediate_size, c.hidden_size, False, False)):
            cfg, regs, barriers = compile_registers(hidden, out_cols, norm, gated)
            per_warp = -(-regs * 32 // 256) * 256
            fits = REGISTERS_PER_SM // (per_warp * cfg.num_warps)
            print(f"| {name} | {label} | {cfg.block_m}, {cfg.block_n}, {cfg.block_k}, {cfg.num_warps} | {regs} | {fits} | {barriers} |")


if __name__ == "__main__":
    main()
