"""The fused Triton kernels equal the pure-torch reference path.

Every kernel test runs on two devices:

- ``cpu-interpreter``: Triton's interpreter (numpy) on CPU tensors, in this process. It needs no
  ``TRITON_INTERPRET`` variable (``kernels.backend.DeviceKernel`` picks the interpreter per
  launch); the tests skip, with the reason, when the interpreter cannot run a probe kernel.
  The interpreter rounds float32 -> bfloat16 by truncation (the GPU rounds to nearest even), so
  bfloat16 results may differ from the reference by one unit in the last place.
- ``cuda``: the compiled kernels (marked ``gpu``; skipped without CUDA).

Shapes are small because the interpreter is slow. The reference is the model's own torch code
(``llama.rms_norm``, ``F.linear``, ``llama.apply_rope``, ``attention.write_kv``,
``attention.decode_attention``),
except that attention is compared with the reference evaluated in float32 on the same inputs
(the kernel accumulates in float32; the bfloat16 reference rounds its scores first).
"""

from __future__ import annotations

import inspect
import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from graphserving.runtime.model import kernels
from graphserving.runtime.model.attention import decode_attention, write_kv
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from graphserving.runtime.model.kernels import backend
from graphserving.runtime.model.kernels.decode_splits import MAX_SPLITS, choose_num_splits
from graphserving.runtime.model.llama import apply_rope, rms_norm
from graphserving.runtime.model.config import ModelConfig
from graphserving.runtime.model.presets import random_model

pytestmark = pytest.mark.skipif(not kernels.triton_importable(), reason="triton is not installed")

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run our kernels here, or None when a probe runs correctly.

    The probe is the decode-attention kernel on a tiny context: it has a loop whose bounds are
    loaded from memory, which some interpreter releases cannot run (Triton 3.6's interpreter calls
    ``int()`` on one-element arrays, an error with numpy 2).
    """
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 16, generator=gen)
        cache = torch.randn(2, 2, 16, 2, 16, generator=gen)
        table = torch.tensor([[1]], dtype=torch.int32)
        seq_lens = torch.tensor([3], dtype=torch.int32)
        out = kernels.paged_decode_attention(q, cache[0], cache[1], table, seq_lens, 0.25)
    except Exception as exc:  # any failure of the interpreter itself
        return f"{type(exc).__name__}: {exc}"
    expected = decode_attention(q, cache[0], cache[1], table, seq_lens, 0.25)
    if not torch.allclose(out, expected, atol=1e-5):
        return f"probe kernel gave {out.flatten()[:4].tolist()}..., expected {expected.flatten()[:4].tolist()}..."
    return None


@pytest.fixture(scope="module")
def interpreter_problem() -> str | None:
    return _interpreter_problem()


DEVICES = [
    pytest.param("cpu", id="cpu-interpreter"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=DEVICES)
def device(request, interpreter_problem) -> torch.device:
    """The device a kernel test runs on (skips with the reason when it cannot)."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
    elif interpreter_problem is not None:
        pytest.skip(f"Triton interpreter cannot run here: {interpreter_problem}")
    return torch.device(request.param)


def tolerances(dtype: torch.dtype) -> dict:
    """assert_close tolerances: float32 tight; bfloat16 about two units in the last place."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def randn(*shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (identical on every device), then moved."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(1)
    x = randn(5, 96, dtype=dtype, device=device, gen=gen, scale=3.0)
    weight = randn(96, dtype=dtype, device=device, gen=gen)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_the_sum_and_its_norm(device, dtype):
    gen = torch.Generator().manual_seed(2)
    x = randn(4, 576, dtype=dtype, device=device, gen=gen)
    residual = randn(4, 576, dtype=dtype, device=device, gen=gen)
    weight = randn(576, dtype=dtype, device=device, gen=gen)
    normed, new_residual = kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, x + residual, **tolerances(dtype))
    torch.testing.assert_close(normed, rms_norm(x + residual, weight, 1e-6), **tolerances(dtype))


def test_fused_add_rms_norm_leaves_its_inputs_unchanged(device):
    gen = torch.Generator().manual_seed(3)
    x, residual = (randn(3, 64, dtype=torch.float32, device=device, gen=gen) for _ in range(2))
    weight = torch.ones(64, device=device)
    x_before, residual_before = x.clone(), residual.clone()
    kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_fused_add_rms_norm_rejects_a_residual_of_another_shape():
    with pytest.raises(ValueError, match=r"residual \(2, 64\)"):
        kernels.fused_add_rms_norm(torch.zeros(3, 64), torch.zeros(2, 64), torch.ones(64), 1e-5)


# ---------------------------------------------------------------------- SwiGLU

@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = randn(3, 2 * 1536, dtype=dtype, device=device, gen=gen, scale=2.0)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate) * up, **tolerances(dtype))


def test_silu_and_mul_rejects_an_odd_width():
    with pytest.raises(ValueError, match="2 \\* I, got 7"):
        kernels.silu_and_mul(torch.zeros(2, 7))


# ---------------------------------------------------------------------- RMSNorm fused into the projection

def norm_linear_reference(x, residual, norm_weight, weight, bias, eps, activation=None):
    """The unfused torch reference: ``rms_norm(x + residual)``, ``F.linear`` (+ SwiGLU)."""
    s = x if residual is None else x + residual
    out = F.linear(rms_norm(s, norm_weight, eps), weight, bias)
    if activation == "silu_and_mul":
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out, s


def norm_linear_tolerances(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """float32: the order of the summation. bfloat16: ``h`` may differ by one unit in the last
    place (the interpreter truncates), which the matmul spreads over the row: a fraction of the
    output's scale."""
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=float(expected.abs().max()) / 64, rtol=2e-2)


NORM_LINEAR_VARIANTS = [
    pytest.param(False, False, None, id="plain"),
    pytest.param(True, True, None, id="residual-bias"),
    pytest.param(True, False, "silu_and_mul", id="residual-silu"),
    pytest.param(False, True, "silu_and_mul", id="bias-silu"),
]


def norm_linear_inputs(m, k, n, dtype, device, has_residual, has_bias, seed=11):
    gen = torch.Generator().manual_seed(seed)
    x = randn(m, k, dtype=dtype, device=device, gen=gen, scale=2.0)
    residual = randn(m, k, dtype=dtype, device=device, gen=gen) if has_residual else None
    norm_weight = randn(k, dtype=dtype, device=device, gen=gen)
    weight = randn(n, k, dtype=dtype, device=device, gen=gen, scale=k ** -0.5)
    bias = randn(n, dtype=dtype, device=device, gen=gen) if has_bias else None
    return x, residual, norm_weight, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("k", [64, 96])
@pytest.mark.parametrize("n", [48, 160])
@pytest.mark.parametrize("has_residual,has_bias,activation", NORM_LINEAR_VARIANTS)
def test_fused_add_rms_norm_linear_matches_reference(device, dtype, m, k, n, has_residual, has_bias, activation):
    x, residual, norm_weight, weight, bias = norm_linear_inputs(m, k, n, dtype, device, has_residual, has_bias)
    out, stream = kernels.fused_add_rms_norm_linear(x, residual, norm_weight, weight, bias, 1e-5, activation)
    expected, expected_stream = norm_linear_reference(x, residual, norm_weight, weight, bias, 1e-5, activation)
    assert out.dtype == dtype and out.shape == expected.shape == (m, n // 2 if activation else n)
    torch.testing.assert_close(out, expected, **norm_linear_tolerances(dtype, expected))
    if residual is None:
        assert stream is x, "without a residual the stream is x itself"
    else:
        torch.testing.assert_close(stream, expected_stream, **tolerances(dtype))


@pytest.mark.parametrize("activation", [None, "silu_and_mul"])
def test_fused_add_rms_norm_linear_equals_the_unfused_kernels(device, activation):
    """Against the kernels it replaces on the same device (same roundings of s and h): float32
    differs only by the order of the summation, the residual stream not at all."""
    x, residual, norm_weight, weight, bias = norm_linear_inputs(5, 96, 160, torch.float32, device, True, False)
    out, stream = kernels.fused_add_rms_norm_linear(x, residual, norm_weight, weight, None, 1e-6, activation)
    h, expected_stream = kernels.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    expected = F.linear(h, weight)
    if activation:
        expected = kernels.silu_and_mul(expected)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fused_add_rms_norm_linear_leaves_its_inputs_unchanged(device):
    inputs = norm_linear_inputs(3, 64, 48, torch.float32, device, True, True)
    before = [t.clone() for t in inputs]
    kernels.fused_add_rms_norm_linear(*inputs, 1e-5, "silu_and_mul")
    kernels.fused_add_rms_norm_linear(*inputs, 1e-5)
    assert all(torch.equal(t, b) for t, b in zip(inputs, before))


NORM_LINEAR_SHAPE_ERRORS = [
    (dict(residual=torch.zeros(2, 64)), r"residual \(2, 64\).*does not match x \(3, 64\)"),
    (dict(norm_weight=torch.ones(32)), r"norm_weight has shape \(32,\), expected \(64,\)"),
    (dict(weight=torch.zeros(48, 32)), r"weight has shape \(48, 32\), expected \[N, K=64\]"),
    (dict(bias=torch.zeros(47)), r"bias has shape \(47,\), expected \(48,\)"),
    (dict(weight=torch.zeros(47, 64), bias=None, activation="silu_and_mul"), r"2 \* I, got weight \(47, 64\)"),
    (dict(activation="gelu"), "activation must be one of"),
    (dict(x=torch.zeros(1, 3, 64), residual=None), r"x must be \[M, K\], got shape \(1, 3, 64\)"),
    (dict(weight=torch.zeros(48, 64, dtype=torch.bfloat16)), "weight dtype torch.bfloat16 does not match"),
]
"""Bad arguments of a norm + projection kernel and the error each must raise (both kernels share the check)."""


def call_with_bad_arguments(fn, args: dict, message: str) -> None:
    call = dict(x=torch.zeros(3, 64), residual=torch.zeros(3, 64), norm_weight=torch.ones(64),
                weight=torch.zeros(48, 64), bias=torch.zeros(48), eps=1e-5, activation=None)
    call.update(args)
    with pytest.raises(ValueError, match=message):
        fn(**call)


@pytest.mark.parametrize("args,message", NORM_LINEAR_SHAPE_ERRORS)
def test_fused_add_rms_norm_linear_rejects_mismatched_shapes(args, message):
    call_with_bad_arguments(kernels.fused_add_rms_norm_linear, args, message)


def test_fused_norm_linear_policy_is_a_function_of_shapes(monkeypatch):
    from graphserving.runtime.model.kernels import norm_linear

    # default: off (measured slower than norm + cuBLAS on the H200)
    assert not kernels.use_fused_norm_linear(1, 576, 960)
    monkeypatch.setattr(norm_linear, "MAX_FUSED_TOKENS", 64)
    assert kernels.use_fused_norm_linear(1, 576, 960)  # SmolLM2 decode: QKV
    assert kernels.use_fused_norm_linear(64, 2048, 16384)  # Llama-3.2-1B, batch 64: gate/up
    assert not kernels.use_fused_norm_linear(65, 576, 960)  # a prefill: cuBLAS
    assert not kernels.use_fused_norm_linear(1, 4096, 6144)  # Llama-3-8B keeps cuBLAS
    assert not kernels.use_fused_norm_linear(0, 576, 960)
    assert norm_linear.MAX_FUSED_HIDDEN == 2048


def test_norm_linear_config_spreads_a_small_weight_over_the_device():
    from graphserving.runtime.model.kernels.norm_linear import choose_config

    qkv = choose_config(1, 576, 960, gated=False, num_sms=132)  # SmolLM2 decode
    # 60 programs; all five K tiles of 128 in flight at once; the row RMS pass fully unrolled
    assert (qkv.block_m, qkv.block_n, qkv.block_k, qkv.num_stages, qkv.norm_unroll) == (16, 16, 128, 5, 5)
    gate_up = choose_config(1, 576, 1536, gated=True, num_sms=132)
    assert (gate_up.block_n, gate_up.num_stages) == (16, 5)  # 96 programs, each 16 gate + 16 up rows
    big = choose_config(1, 4096, 14336, gated=True, num_sms=132)
    assert (big.block_n, big.block_k, big.num_stages) == (64, 128, 3)  # 224 programs; shared memory caps stages
    assert choose_config(64, 2048, 3072, gated=False, num_sms=132).block_m == 64  # one row block
    assert choose_config(65, 2048, 3072, gated=False, num_sms=132).block_m == 64
    assert choose_config(3, 64, 48, gated=False, num_sms=4).block_k == 64


@pytest.mark.parametrize("config", [
    dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, norm_unroll=3),
    dict(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=3, norm_unroll=4),
], ids=["k-tiles-of-32", "k-tiles-of-16-partly-unrolled"])
@pytest.mark.parametrize("activation", [None, "silu_and_mul"])
def test_fused_add_rms_norm_linear_with_several_k_tiles(device, config, activation):
    """Explicit small tiles: several K steps with a masked tail (96 = 3 x 32 = 6 x 16), row blocks
    of 16 for 17 rows (two row blocks) and 32 (one), and column blocks with a masked tail."""
    from graphserving.runtime.model.kernels.norm_linear import NormLinearConfig

    x, residual, norm_weight, weight, bias = norm_linear_inputs(17, 96, 176, torch.float32, device, True, True)
    out, stream = kernels.fused_add_rms_norm_linear(x, residual, norm_weight, weight, bias, 1e-5, activation,
                                                    config=NormLinearConfig(**config))
    expected, expected_stream = norm_linear_reference(x, residual, norm_weight, weight, bias, 1e-5, activation)
    torch.testing.assert_close(out, expected, **norm_linear_tolerances(torch.float32, expected))
    assert torch.equal(stream, expected_stream)


# ---------------------------------------------------------------------- skinny GEMM (decode batches)

GEMV_VARIANTS = [
    pytest.param(False, False, False, None, id="plain"),
    pytest.param(False, False, True, None, id="plain-bias"),
    pytest.param(True, False, False, None, id="norm"),
    pytest.param(True, True, True, None, id="norm-residual-bias"),
    pytest.param(True, True, False, "silu_and_mul", id="norm-residual-silu"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k,n", [(64, 48), (96, 160)])
@pytest.mark.parametrize("norm,has_residual,has_bias,activation", GEMV_VARIANTS)
def test_skinny_gemm_matches_reference(device, dtype, m, k, n, norm, has_residual, has_bias, activation):
    x, residual, norm_weight, weight, bias = norm_linear_inputs(m, k, n, dtype, device, has_residual, has_bias)
    if norm:
        out, stream = kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, weight, bias, 1e-5, activation)
        expected, expected_stream = norm_linear_reference(x, residual, norm_weight, weight, bias, 1e-5, activation)
        if residual is None:
            assert stream is x, "without a residual the stream is x itself"
        else:
            torch.testing.assert_close(stream, expected_stream, **tolerances(dtype))
    else:
        out, expected = kernels.gemv(x, weight, bias), F.linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == expected.shape == (m, n // 2 if activation else n)
    tol = norm_linear_tolerances(dtype, expected)
    if device.type == "cpu" and dtype == torch.bfloat16 and activation:
        # The interpreter truncates h to bfloat16; through the gate's product one output of the
        # 8 x 24 here moves by 6 units in the last place (norm_linear's kernel gives the same value).
        tol["atol"] *= 4
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("activation", [None, "silu_and_mul"])
def test_skinny_gemm_equals_the_kernels_it_replaces(device, activation):
    """Against the unfused kernels on the same device (same roundings of s and h): float32 differs
    only by the order of the summation, the residual stream not at all."""
    x, residual, norm_weight, weight, _ = norm_linear_inputs(5, 96, 160, torch.float32, device, True, False)
    out, stream = kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, weight, None, 1e-6, activation)
    h, expected_stream = kernels.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    expected = F.linear(h, weight)
    if activation:
        expected = kernels.silu_and_mul(expected)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [
    dict(block_m=4, block_n=4, block_k=32),
    dict(block_m=8, block_n=16, block_k=16),
    dict(block_m=2, block_n=1, block_k=128),
    dict(block_m=4, block_n=4, block_k=32, ahead=2),
    dict(block_m=1, block_n=16, block_k=16, ahead=2),
    dict(block_m=4, block_n=4, block_k=64, ahead=2),
    dict(block_m=2, block_n=1, block_k=128, ahead=2),
], ids=["k-tiles-of-32", "k-tiles-of-16-wide-n", "one-k-tile-one-column", "k-tiles-of-32-two-ahead",
        "k-tiles-of-16-two-ahead", "a-partial-second-k-tile-two-ahead", "one-k-tile-two-ahead"])
@pytest.mark.parametrize("activation", [None, "silu_and_mul"])
def test_skinny_gemm_with_several_k_tiles_and_column_blocks(device, config, activation):
    """Explicit tiles: several K steps (96 = 3 x 32 = 6 x 16), a masked K tail (96 = 64 + 32), K inside
    one tile (128), the weight tiles loaded one or two steps ahead, row blocks wider than the rows (3 of
    4 or 8), and column blocks with a masked tail (176 / 16); one column per program."""
    from graphserving.runtime.model.kernels.skinny_gemm import GemvConfig

    m = min(3, config["block_m"])
    x, residual, norm_weight, weight, bias = norm_linear_inputs(m, 96, 176, torch.float32, device, True, True)
    out, stream = kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, weight, bias, 1e-5, activation,
                                                  config=GemvConfig(**config))
    expected, expected_stream = norm_linear_reference(x, residual, norm_weight, weight, bias, 1e-5, activation)
    torch.testing.assert_close(out, expected, **norm_linear_tolerances(torch.float32, expected))
    assert torch.equal(stream, expected_stream)
    plain = kernels.gemv(x, weight, bias, config=GemvConfig(**config))
    torch.testing.assert_close(plain, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_k", [32, 128], ids=["k-tiles-of-32", "one-k-tile"])
def test_skinny_gemm_hands_on_the_normed_rows_it_projected(device, dtype, block_k):
    """return_normed: h (the rows the router projects, then the experts' input) equals the norm
    kernel's output, and the projection equals h @ weight.T (an MoE layer's router, one kernel)."""
    from graphserving.runtime.model.kernels.skinny_gemm import GemvConfig

    x, residual, norm_weight, weight, _ = norm_linear_inputs(1, 96, 40, dtype, device, True, False)
    out, stream, h = kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, weight, None, 1e-6, return_normed=True,
                                                     config=GemvConfig(1, 8, block_k))
    expected_h, expected_stream = kernels.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(h, expected_h, **tolerances(dtype))
    torch.testing.assert_close(out, F.linear(h, weight), **norm_linear_tolerances(dtype, out))
    with pytest.raises(ValueError, match="return_normed needs a weight of at least one row"):
        kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, weight[:0], None, 1e-6, return_normed=True)


def test_skinny_gemm_reads_strided_rows_and_weights(device):
    """Row strides other than K: a view into a wider activation buffer, a weight with padded rows."""
    gen = torch.Generator().manual_seed(4)
    x = randn(3, 120, dtype=torch.float32, device=device, gen=gen)[:, 7:107]
    residual = randn(3, 130, dtype=torch.float32, device=device, gen=gen)[:, :100]
    norm_weight = randn(100, dtype=torch.float32, device=device, gen=gen)
    weight = randn(74, 111, dtype=torch.float32, device=device, gen=gen, scale=0.1)[:, :100]
    bias = randn(74, dtype=torch.float32, device=device, gen=gen)
    out, stream = kernels.fused_add_rms_norm_gemv(x, residual, norm_weight, weight, bias, 1e-5, "silu_and_mul")
    expected, expected_stream = norm_linear_reference(x, residual, norm_weight, weight, bias, 1e-5, "silu_and_mul")
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(kernels.gemv(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_skinny_gemm_writes_into_a_given_output_and_rejects_one_that_does_not_fit(device):
    """``out=``: a graph's static logits buffer (a strided view of a wider one) written in place."""
    gen = torch.Generator().manual_seed(6)
    x = randn(2, 96, dtype=torch.bfloat16, device=device, gen=gen)
    weight = randn(40, 96, dtype=torch.bfloat16, device=device, gen=gen, scale=0.1)
    buffer = torch.full((4, 48), -7.0, dtype=torch.float32, device=device)
    out = buffer[:2, :40]
    assert kernels.gemv(x, weight, out_dtype=torch.float32, out=out) is out
    assert torch.equal(out, kernels.gemv(x, weight, out_dtype=torch.float32))
    assert buffer[2:].eq(-7.0).all() and buffer[:, 40:].eq(-7.0).all()  # nothing outside it
    for bad in (buffer[:3, :40], buffer[:2, :40].to(torch.bfloat16), buffer[:2, :40].t().contiguous().t()):
        with pytest.raises(ValueError, match="out must be"):
            kernels.gemv(x, weight, out_dtype=torch.float32, out=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_16_bit_lm_head_product_writes_float32_directly():
    """cuBLAS with a float32 output (``torch.mm``'s ``out_dtype``): no cast kernel after the LM head,
    and no rounding of the logits to bfloat16 in between."""
    gen = torch.Generator().manual_seed(8)
    x = randn(16, 256, dtype=torch.bfloat16, device="cuda", gen=gen)
    weight = randn(1000, 256, dtype=torch.bfloat16, device="cuda", gen=gen, scale=0.1)
    assert kernels.mm_writes_float32(x) and not kernels.mm_writes_float32(x.float())
    out = torch.empty(16, 1000, dtype=torch.float32, device="cuda")
    torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
    torch.testing.assert_close(out, x.float() @ weight.float().t(), atol=1e-3, rtol=1e-3)
    assert not kernels.mm_writes_float32(x.cpu())


def test_skinny_gemm_rejects_a_row_block_smaller_than_the_rows():
    from graphserving.runtime.model.kernels.skinny_gemm import GemvConfig

    with pytest.raises(ValueError, match="block_m=1 is smaller than the 4 rows"):
        kernels.gemv(torch.zeros(4, 64), torch.zeros(8, 64), config=GemvConfig(1, 8, 64))


def test_skinny_gemm_writes_float32_logits_from_bfloat16_weights(device):
    x, _, _, weight, _ = norm_linear_inputs(2, 64, 48, torch.bfloat16, device, False, False)
    logits = kernels.gemv(x, weight, out_dtype=torch.float32)
    expected = F.linear(x.float(), weight.float())
    assert logits.dtype == torch.float32
    # accumulated in float32 and never rounded to bfloat16: within float32 summation error
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_skinny_gemm_leaves_its_inputs_unchanged(device):
    inputs = norm_linear_inputs(3, 64, 48, torch.float32, device, True, True)
    before = [t.clone() for t in inputs]
    kernels.fused_add_rms_norm_gemv(*inputs, 1e-5, "silu_and_mul")
    kernels.fused_add_rms_norm_gemv(*inputs, 1e-5)
    kernels.gemv(inputs[0], inputs[3], inputs[4])
    assert all(torch.equal(t, b) for t, b in zip(inputs, before))


@pytest.mark.parametrize("args,message", [
    (dict(x=torch.zeros(9, 64), residual=torch.zeros(9, 64)), "9 rows; the skinny GEMM serves at most 8"),
    *NORM_LINEAR_SHAPE_ERRORS,
])
def test_skinny_gemm_rejects_mismatched_shapes(args, message):
    call_with_bad_arguments(kernels.fused_add_rms_norm_gemv, args, message)


@pytest.mark.parametrize("fn", ["fused_add_rms_norm_linear", "fused_add_rms_norm_gemv"])
def test_a_projection_to_no_columns_still_returns_the_residual_stream(fn):
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    out, stream = getattr(kernels, fn)(x, residual, torch.ones(64), torch.zeros(0, 64), None, 1e-5)
    assert out.shape == (3, 0)
    assert torch.equal(stream, x + residual)


def test_skinny_gemm_policy_serves_decode_batches_only(monkeypatch):
    from graphserving.runtime.model.kernels import skinny_gemm

    for name in (skinny_gemm.GEMV_ENV, skinny_gemm.GEMV_WIDE_ENV, skinny_gemm.GEMV_TOKENS_ENV,
                 skinny_gemm.GEMV_WEIGHT_ENV, skinny_gemm.GEMV_HIDDEN_ENV):
        monkeypatch.delenv(name, raising=False)
    assert kernels.use_gemv(1, 960, 576, 576) and kernels.use_gemv(1, 2048, 8192, 2048)  # SmolLM2 QKV, 1B down
    assert kernels.use_gemv(1, 128256, 2048, 2048)  # Llama-3.2-1B's LM head, 501 MiB
    assert not kernels.use_gemv(1, 4096, 4096, 4096)  # Llama-3-8B's O: under the weight bound, hidden 4096
    assert not kernels.use_gemv(2, 960, 576, 576)  # by default cuBLAS from two rows on (measured)
    assert not kernels.use_gemv(0, 960, 576, 576)
    monkeypatch.setattr(skinny_gemm, "GEMV_MAX_TOKENS", skinny_gemm.MAX_ROWS)
    assert kernels.use_gemv(8, 960, 576, 576) and not kernels.use_gemv(9, 960, 576, 576)
    monkeypatch.setenv(skinny_gemm.GEMV_ENV, "all")
    assert kernels.use_gemv(1, 128256, 2048, 2048) and kernels.use_gemv(1, 4096, 4096, 4096)
    assert not kernels.use_gemv(9, 960, 576, 576)
    monkeypatch.setenv(skinny_gemm.GEMV_ENV, "0")
    assert not kernels.use_gemv(1, 960, 576, 576)
    monkeypatch.setenv(skinny_gemm.GEMV_ENV, "yes")
    with pytest.raises(ValueError, match="GRAPHSERVING_GEMV='yes': expected 0"):
        kernels.use_gemv(1, 960, 576, 576)
    monkeypatch.setenv(skinny_gemm.GEMV_ENV, "1")
    monkeypatch.setenv(skinny_gemm.GEMV_TOKENS_ENV, "5")  # verification passes of k = 4 at batch 1
    assert kernels.use_gemv(5, 960, 576, 576) and not kernels.use_gemv(6, 960, 576, 576)
    for bad in ("0", "9", "two"):
        monkeypatch.setenv(skinny_gemm.GEMV_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=f"GRAPHSERVING_GEMV_MAX_TOKENS='{bad}': expected a row count in 1..8"):
            kernels.use_gemv(1, 960, 576, 576)
    monkeypatch.delenv(skinny_gemm.GEMV_TOKENS_ENV)
    assert kernels.use_gemv(1, 262144, 2048, 2048)  # 1 GiB: at the bound
    assert not kernels.use_gemv(1, 262145, 2048, 2048)
    monkeypatch.setenv(skinny_gemm.GEMV_WEIGHT_ENV, "40")  # a bound of earlier sessions (bench/RESULTS.md)
    assert not kernels.use_gemv(1, 16384, 2048, 2048) and kernels.use_gemv(1, 10240, 2048, 2048)
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(skinny_gemm.GEMV_WEIGHT_ENV, bad)
        with pytest.raises(ValueError, match="GRAPHSERVING_GEMV_MAX_WEIGHT_MIB"):
            kernels.use_gemv(1, 960, 576, 576)
    monkeypatch.delenv(skinny_gemm.GEMV_WEIGHT_ENV)
    assert not kernels.use_gemv(1, 4096, 4096, 4096)  # Llama-3-8B's O projection: hidden above the bound
    monkeypatch.setenv(skinny_gemm.GEMV_HIDDEN_ENV, "4096")
    assert kernels.use_gemv(1, 4096, 4096, 4096) and kernels.use_gemv(1, 28672, 4096, 4096)  # 8B O, gate/up
    assert not kernels.use_gemv(1, 262145, 4096, 4096)  # above the weight bound
    monkeypatch.setenv(skinny_gemm.GEMV_HIDDEN_ENV, "wide")
    with pytest.raises(ValueError, match="GRAPHSERVING_GEMV_MAX_HIDDEN='wide': expected a positive whole number"):
        kernels.use_gemv(1, 960, 576, 576)


def test_skinny_gemm_policy_widens_the_hidden_bound_on_the_devices_measured_to_gain(monkeypatch):
    """On a device of ``WIDE_HIDDEN_DEVICES`` Llama-3-8B's O, gate/up, down and LM head take the skinny
    GEMM and its QKV (``norm_only``) stays on cuBLAS; on any other device, and on the CPU, the plain
    bound holds; ``GRAPHSERVING_GEMV_WIDE_HIDDEN`` applies the wide policy anywhere."""
    from graphserving.runtime.model.kernels import skinny_gemm

    for name in (skinny_gemm.GEMV_ENV, skinny_gemm.GEMV_HIDDEN_ENV, skinny_gemm.GEMV_WEIGHT_ENV,
                 skinny_gemm.GEMV_TOKENS_ENV, skinny_gemm.GEMV_WIDE_ENV):
        monkeypatch.delenv(name, raising=False)
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(skinny_gemm, "device_name", lambda index: names[index])
    listed, other = torch.device("cuda", 0), torch.device("cuda", 1)
    assert skinny_gemm.WIDE_HIDDEN_DEVICES[names[0]] == {4096} and names[1] not in skinny_gemm.WIDE_HIDDEN_DEVICES
    for out_features, in_features in ((4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        assert kernels.use_gemv(1, out_features, in_features, 4096, device=listed)
        assert kernels.use_gemv(1, out_features, in_features, 4096, device="cuda:0")
        assert not kernels.use_gemv(1, out_features, in_features, 4096, device=other)
        assert not kernels.use_gemv(1, out_features, in_features, 4096, device=torch.device("cpu"))
        assert not kernels.use_gemv(1, out_features, in_features, 4096)
        assert not kernels.use_gemv(2, out_features, in_features, 4096, device=listed)  # one row only
    assert not kernels.use_gemv(1, 151936, 4096, 4096, device=listed)  # Qwen3-8B's LM head: above 1 GiB
    assert not kernels.use_gemv(1, 6144, 4096, 4096, device=listed, norm_only=True)
    assert kernels.use_gemv(1, 2560, 2048, 2048, device=listed, norm_only=True)  # the plain bound still holds
    assert not kernels.use_gemv(1, 3072, 3072, 3072, device=listed)  # a hidden size not measured there
    assert not kernels.use_gemv(1, 4096, 8192, 8192, device=listed)
    monkeypatch.setenv(skinny_gemm.GEMV_WIDE_ENV, "3072")  # the wide policy for another size, on any device
    assert kernels.use_gemv(1, 3072, 3072, 3072, device=other) and kernels.use_gemv(1, 3072, 3072, 3072)
    assert not kernels.use_gemv(1, 5120, 3072, 3072, device=other, norm_only=True)
    assert not kernels.use_gemv(1, 4096, 4096, 4096, device=listed)  # the variable replaces the device's sizes
    monkeypatch.setenv(skinny_gemm.GEMV_WIDE_ENV, "wide")
    with pytest.raises(ValueError, match="GRAPHSERVING_GEMV_WIDE_HIDDEN='wide': expected a positive whole number"):
        kernels.use_gemv(1, 4096, 4096, 4096, device=listed)
    monkeypatch.delenv(skinny_gemm.GEMV_WIDE_ENV)
    monkeypatch.setenv(skinny_gemm.GEMV_HIDDEN_ENV, "4096")  # one bound for every projection, on any device
    assert kernels.use_gemv(1, 6144, 4096, 4096, device=other, norm_only=True)
    monkeypatch.setenv(skinny_gemm.GEMV_HIDDEN_ENV, "2048")
    assert not kernels.use_gemv(1, 4096, 4096, 4096, device=listed)


def test_skinny_gemm_ahead_comes_from_the_variable_and_is_checked(monkeypatch):
    from graphserving.runtime.model.kernels import skinny_gemm
    from graphserving.runtime.model.kernels.skinny_gemm import GemvConfig, choose_config

    monkeypatch.delenv(skinny_gemm.GEMV_AHEAD_ENV, raising=False)
    assert choose_config(1, 4096, gated=False).ahead == 1
    monkeypatch.setenv(skinny_gemm.GEMV_AHEAD_ENV, "2")
    assert choose_config(1, 4096, gated=False) == GemvConfig(1, 8, 2048, 8, ahead=2)
    for bad in ("0", "3", "two"):
        monkeypatch.setenv(skinny_gemm.GEMV_AHEAD_ENV, bad)
        with pytest.raises(ValueError, match=f"GRAPHSERVING_GEMV_AHEAD='{bad}': expected 1 or 2"):
            choose_config(1, 4096, gated=False)
    monkeypatch.delenv(skinny_gemm.GEMV_AHEAD_ENV)
    with pytest.raises(ValueError, match="ahead=3: 1 or 2"):
        kernels.gemv(torch.zeros(1, 64), torch.zeros(8, 64), config=GemvConfig(1, 8, 64, ahead=3))


def test_skinny_gemm_config_follows_the_measured_rule(monkeypatch):
    from graphserving.runtime.model.kernels.skinny_gemm import (GEMV_AHEAD_ENV, GemvConfig, MAX_TILE_ELEMENTS,
                                                                choose_config)

    monkeypatch.delenv(GEMV_AHEAD_ENV, raising=False)

    # SmolLM2 decode: the whole hidden size (576) in one K tile, 8 weight rows per program
    assert choose_config(1, 576, gated=False) == GemvConfig(1, 8, 1024, 4)
    assert choose_config(1, 576, gated=True) == GemvConfig(1, 4, 1024, 4)  # gate + up tiles
    # Llama-3.2-1B's down projection: four K tiles of 2048, 8 warps for the long loop
    assert choose_config(1, 8192, gated=False) == GemvConfig(1, 8, 2048, 8)
    eight = choose_config(8, 8192, gated=False)
    assert eight.block_m == 8 and eight.block_m * eight.block_n * eight.block_k <= MAX_TILE_ELEMENTS
    assert choose_config(3, 64, gated=False) == GemvConfig(4, 8, 64, 4)
    assert choose_config(5, 2048, gated=True).block_n == 1


# ---------------------------------------------------------------------- RoPE + KV write

def rope_tables(max_positions: int, head_dim: int, dtype, device):
    """cos/sin tables as the model builds them (half-width frequencies repeated)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def qkv_views(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    """q, k, v as strided views of a fused QKV output (how the model hands them over)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(3, 3, 64), (9, 3, 64), (8, 2, 128)], ids=["mha-d64", "gqa3-d64", "gqa4-d128"])
def test_rope_and_write_kv_matches_apply_rope_and_write_kv(device, dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, t = 6, 16, 4
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=device, gen=gen)
    q, k, v = qkv_views(qkv, hq, hkv, d)
    cos, sin = rope_tables(64, d, dtype, device)
    positions = torch.tensor([3, 17, 63, 40], device=device)
    slots = torch.tensor([5 * 16 + 3, 2 * 16 + 15, 1 * 16 + 0, 4 * 16 + 9], device=device)
    cache = randn(2, num_blocks, block_size, hkv, d, dtype=dtype, device=device, gen=gen)
    expected_cache = cache.clone()

    q_rot, k_rot = kernels.rope_and_write_kv(q, k, v, positions, cos, sin, cache, slots)

    q_ref = apply_rope(q, cos[positions], sin[positions])
    k_ref = apply_rope(k, cos[positions], sin[positions])
    write_kv(expected_cache, k_ref, v, slots)
    torch.testing.assert_close(q_rot, q_ref, **tolerances(dtype))
    torch.testing.assert_close(k_rot, k_ref, **tolerances(dtype))
    torch.testing.assert_close(cache, expected_cache, **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_write_kv_with_the_qk_norm_equals_the_reference_norm_then_rope(device, dtype):
    """Qwen3's q/k norm folded into the RoPE kernel equals the reference's per-head RMSNorm followed
    by the RoPE kernel (the same roundings; only the float32 sum of squares differs in order)."""
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d = 4, 2, 128
    qkv = randn(3, (hq + 2 * hkv) * d, dtype=dtype, device=device, gen=gen, scale=3.0)
    q_weight, k_weight = (1.0 + 0.1 * randn(d, dtype=dtype, device=device, gen=gen) for _ in range(2))
    cos, sin = rope_tables(64, d, dtype, device)
    positions = torch.tensor([3, 17, 63], device=device)
    slots = torch.tensor([5 * 16 + 3, 2 * 16 + 15, PAD_SLOT_ID], device=device)
    folded_cache = randn(2, 6, 16, hkv, d, dtype=dtype, device=device, gen=gen)
    separate_cache = folded_cache.clone()

    q_folded, k_folded = kernels.rope_and_write_kv(*qkv_views(qkv, hq, hkv, d), positions, cos, sin, folded_cache,
                                                   slots, qk_norm=(q_weight, k_weight, 1e-6))
    normed = qk_normed(qkv, q_weight, k_weight, hq, hkv, 1e-6)
    q_sep, k_sep = kernels.rope_and_write_kv(*qkv_views(normed, hq, hkv, d), positions, cos, sin, separate_cache, slots)

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(q_folded, q_sep, **tol)
    torch.testing.assert_close(k_folded, k_sep, **tol)
    torch.testing.assert_close(folded_cache, separate_cache, **tol)


def qk_normed(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, hq: int, hkv: int,
              eps: float) -> torch.Tensor:
    """``qkv`` [T, (Hq + 2 * Hkv) * D] with every query and key head through the reference RMSNorm."""
    q, k, v = qkv.split([hq * q_weight.shape[0], hkv * q_weight.shape[0], hkv * q_weight.shape[0]], dim=-1)
    rows = qkv.shape[0]
    return torch.cat([rms_norm(q.reshape(rows, hq, -1), q_weight, eps).reshape(rows, -1),
                      rms_norm(k.reshape(rows, hkv, -1), k_weight, eps).reshape(rows, -1), v], dim=-1)


def test_rope_and_write_kv_rejects_qk_norm_weights_of_another_head_dim():
    qkv = torch.zeros(1, 6 * 16)
    with pytest.raises(ValueError, match=r"qk_norm weights must be \[D=16\]"):
        kernels.rope_and_write_kv(*qkv_views(qkv, 2, 2, 16), torch.zeros(1, dtype=torch.long), torch.ones(4, 16),
                                  torch.ones(4, 16), torch.zeros(2, 2, 16, 2, 16), torch.zeros(1, dtype=torch.long),
                                  qk_norm=(torch.ones(8), torch.ones(16), 1e-6))


def test_rope_and_write_kv_sends_padded_rows_to_the_null_block_only(device):
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d, block_size = 4, 2, 64, 16
    qkv = randn(3, (hq + 2 * hkv) * d, dtype=torch.float32, device=device, gen=gen)
    q, k, v = qkv_views(qkv, hq, hkv, d)
    cos, sin = rope_tables(8, d, torch.float32, device)
    cache = torch.full((2, 4, block_size, hkv, d), 7.0, device=device)
    slots = torch.tensor([PAD_SLOT_ID, 3 * block_size + 2, PAD_SLOT_ID], device=device)

    q_rot, k_rot = kernels.rope_and_write_kv(q, k, v, torch.tensor([0, 5, 0], device=device), cos, sin, cache,
                                             slots, return_k=False)

    written = torch.zeros(4, block_size, dtype=torch.bool)
    written[NULL_BLOCK, 0] = True
    written[3, 2] = True
    assert torch.all(cache[:, ~written.to(device)] == 7.0), "a slot other than the null block's slot 0 changed"
    null_value = cache[1, NULL_BLOCK, 0]
    # Both padded rows write the null slot at once; their stores may interleave (the null block is
    # never read), so each element comes from one of them.
    assert torch.all((null_value == v[0]) | (null_value == v[2])), "only a padded row's values may land there"
    assert torch.equal(cache[1, 3, 2], v[1])
    assert k_rot is None and q_rot.shape == q.shape


def test_rope_and_write_kv_rejects_a_slot_mapping_of_another_length():
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    cos = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(3,\), expected \(2,\)"):
        kernels.rope_and_write_kv(q, k, k, torch.zeros(2, dtype=torch.int64), cos, cos,
                                  torch.zeros(2, 2, 4, 1, 8), torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------- paged decode attention

class PagedContext:
    """Per-row K/V histories in scrambled, non-contiguous blocks of a paged cache.

    Block-table entries past each row's blocks point at a block full of NaN (as do the slots
    past ``seq_len`` in a row's last block and the null block), so any read the kernel should
    not make poisons the output.
    """

    def __init__(self, seq_lens, hq, hkv, d, dtype, device, block_size=16, width=12, seed=0):
        gen = torch.Generator().manual_seed(seed)
        n = len(seq_lens)
        num_blocks = 2 + sum(-(-s // block_size) for s in seq_lens)
        poison = num_blocks - 1
        self.k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        blocks = list(range(1, poison))
        random.Random(seed).shuffle(blocks)
        table = torch.full((n, width), poison, dtype=torch.int32)
        for row, seq_len in enumerate(seq_lens):
            for j in range(-(-seq_len // block_size)):
                block = blocks.pop()
                table[row, j] = block
                used = min(block_size, seq_len - j * block_size)
                self.k_cache[block, :used] = torch.randn(used, hkv, d, generator=gen).to(dtype)
                self.v_cache[block, :used] = torch.randn(used, hkv, d, generator=gen).to(dtype)
        self.q = torch.randn(n, hq, d, generator=gen).to(dtype)
        self.block_table = table
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = d ** -0.5
        for name in ("k_cache", "v_cache", "block_table", "seq_lens", "q"):
            setattr(self, name, getattr(self, name).to(device))

    def kernel(self, **overrides) -> torch.Tensor:
        return kernels.paged_decode_attention(self.q, self.k_cache, self.v_cache, self.block_table,
                                              self.seq_lens, self.scale, **overrides)

    def reference(self) -> torch.Tensor:
        """decode_attention in float32 on the same values, NaN-free slots where it would mask them."""
        k = torch.nan_to_num(self.k_cache.float())
        v = torch.nan_to_num(self.v_cache.float())
        return decode_attention(self.q.float(), k, v, self.block_table, self.seq_lens, self.scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 2)], ids=["group1", "group3", "group4"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [1, None, 3], ids=["one-split", "auto-splits", "three-splits"])
def test_paged_decode_attention_matches_reference(device, dtype, hq, hkv, d, num_splits):
    # seq_lens off block and tile boundaries, a full block, and a row with a single key
    ctx = PagedContext([37, 16, 1, 70], hq, hkv, d, dtype, device)
    out = ctx.kernel(num_splits=num_splits)
    assert out.dtype == dtype and out.shape == ctx.q.shape
    assert torch.isfinite(out).all(), "a slot past seq_len or a block past the row's blocks was read"
    torch.testing.assert_close(out.float(), ctx.reference(), **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, None, 3], ids=["one-split", "auto-splits", "three-splits"])
def test_prefetching_the_first_tile_changes_no_bit(device, dtype, num_splits):
    """A uniform-decode batch's prefetch (metadata and first context tile before the PDL wait, the
    newest key put in after it) gives exactly the output without it: rows whose newest key falls in
    a split's first tile, in a later tile, a single-key row and a row without keys."""
    ctx = PagedContext([37, 16, 1, 70, 0], 8, 2, 64, dtype, device)
    plain = ctx.kernel(num_splits=num_splits)
    prefetched = ctx.kernel(num_splits=num_splits, prefetch=True)
    torch.testing.assert_close(prefetched, plain, rtol=0, atol=0)
    assert torch.equal(prefetched[4], torch.zeros_like(prefetched[4]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_pipelining_the_context_loop_changes_no_bit(device, dtype, num_splits, prefetch, monkeypatch):
    """The context loop's explicit prefetch (``PIPELINE``: the next tile's keys and values and the
    tile after it's block-table entries loaded before a tile's softmax step) gives exactly the output
    without it: rows of one tile, several tiles, a single key, no keys; a table whose unused entries
    name a block far past the cache (a load past ``seq_len`` would fault or poison)."""
    from graphserving.runtime.model.kernels import decode_attention

    ctx = PagedContext([37, 16, 1, 70, 0], 8, 2, 64, dtype, device, width=16)
    ctx.block_table[:, 6:] = 10**6
    plain = ctx.kernel(num_splits=num_splits, prefetch=prefetch)
    monkeypatch.setitem(decode_attention.DECODE_LAUNCH, "PIPELINE", True)
    pipelined = ctx.kernel(num_splits=num_splits, prefetch=prefetch)
    torch.testing.assert_close(pipelined, plain, rtol=0, atol=0)
    assert torch.equal(pipelined[4], torch.zeros_like(pipelined[4]))


def test_decode_stages_come_from_the_environment_or_fail_naming_it(monkeypatch):
    from graphserving.runtime.model.kernels import decode_attention

    monkeypatch.delenv("GRAPHSERVING_DECODE_STAGES", raising=False)
    assert decode_attention._stages_from_env() == 2
    monkeypatch.setenv("GRAPHSERVING_DECODE_STAGES", "3")
    assert decode_attention._stages_from_env() == 3
    for bad in ("0", "9", "three"):
        monkeypatch.setenv("GRAPHSERVING_DECODE_STAGES", bad)
        with pytest.raises(ValueError, match=f"GRAPHSERVING_DECODE_STAGES='{bad}': expected a whole number"):
            decode_attention._stages_from_env()


def test_prefetch_only_where_a_head_row_fills_whole_cache_lines(monkeypatch):
    """The prefetch policy (pure logic): head dimensions up to 64 whose key row of one head is a
    multiple of 128 bytes (so the newest key's cache line holds no key loaded before the wait), and
    never with GRAPHSERVING_DECODE_PREFETCH=0."""
    from graphserving.runtime.model.kernels import decode_attention

    assert decode_attention._prefetches(64, 2) and decode_attention._prefetches(64, 4)
    assert not decode_attention._prefetches(32, 2)  # 64-byte rows: two tokens (or heads) per line
    assert not decode_attention._prefetches(128, 2)  # above SMALL_HEAD_DIM: measured slower
    monkeypatch.setattr(decode_attention, "PREFETCH_FIRST_TILE", False)
    assert not decode_attention._prefetches(64, 2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_attention_gives_exact_zeros_for_rows_without_keys(device, num_splits):
    ctx = PagedContext([20, 0, 5, 0], 4, 2, 64, torch.bfloat16, device)
    ctx.block_table[1] = NULL_BLOCK  # padded rows point at the null block, which holds NaN here
    out = ctx.kernel(num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.isfinite(out).all()


def test_paged_decode_attention_cost_follows_seq_len_not_table_width(device):
    """A table as wide as 8192 tokens whose unused entries name a block id far past the cache:
    reading any of them would fault or poison; only the blocks below seq_len are touched."""
    ctx = PagedContext([33, 2], 4, 1, 64, torch.float32, device, width=512)
    expected = ctx.reference()
    ctx.block_table[:, 3:] = 10**6
    torch.testing.assert_close(ctx.kernel(num_splits=2), expected, **tolerances(torch.float32))


@pytest.mark.parametrize("num_splits,kernels_launched", [(1, 1), (3, 2)])
def test_paged_decode_attention_skips_the_combine_for_one_split(monkeypatch, num_splits, kernels_launched):
    from graphserving.runtime.model.kernels import decode_attention as module

    recorders = _record_launches(monkeypatch)
    ctx = PagedContext([20, 3], 4, 2, 64, torch.float32, "cpu")
    ctx.kernel(num_splits=num_splits)
    assert len(recorders) == kernels_launched
    (_, decode_kwargs), = recorders[module._DECODE].launches
    assert decode_kwargs["DIRECT"] is (num_splits == 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128)], ids=["gqa3-d64", "gqa4-d128"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_rope_write_and_decode_attention_equals_rope_and_write_kv_then_attention(device, dtype, hq, hkv, d, num_splits,
                                                                                 qk_norm):
    """The same output and the same cache as the two-kernel path (bit for bit in the interpreter
    without the q/k norm, whose sum of squares adds in another order), a padded row included (it
    writes nothing and gives zeros), the new keys as strided QKV views."""
    seq_lens = [37, 16, 0, 70, 1]
    ctx = PagedContext(seq_lens, hq, hkv, d, dtype, device)
    gen = torch.Generator().manual_seed(8)
    qkv = randn(len(seq_lens), (hq + 2 * hkv) * d, dtype=dtype, device=device, gen=gen)
    q, k, v = qkv_views(qkv, hq, hkv, d)
    cos, sin = rope_tables(128, d, dtype, device)
    positions = torch.tensor([max(s - 1, 0) for s in seq_lens], device=device)
    table = ctx.block_table.cpu()
    slots = torch.tensor([int(table[r, (s - 1) // 16]) * 16 + (s - 1) % 16 if s else -1
                          for r, s in enumerate(seq_lens)], device=device)
    two_kernels = torch.stack([ctx.k_cache, ctx.v_cache])
    fused = two_kernels.clone()
    norm = None
    if qk_norm:
        q_weight, k_weight = (1.0 + 0.2 * randn(d, dtype=dtype, device=device, gen=gen) for _ in range(2))
        norm = (q_weight, k_weight, 1e-6)

    q_rot, _ = kernels.rope_and_write_kv(q, k, v, positions, cos, sin, two_kernels, slots, return_k=False,
                                         qk_norm=norm)
    expected = kernels.paged_decode_attention(q_rot, two_kernels[0], two_kernels[1], ctx.block_table,
                                              ctx.seq_lens, ctx.scale, num_splits=num_splits)
    out = kernels.rope_write_and_decode_attention(q, k, v, positions, cos, sin, fused, slots, ctx.block_table,
                                                  ctx.seq_lens, ctx.scale, num_splits=num_splits, qk_norm=norm)
    assert torch.isfinite(out).all() and torch.equal(out[2], torch.zeros_like(out[2]))
    # exact in the interpreter; compiled, float32 products may contract into FMAs differently
    exact = torch.device(device).type == "cpu" and not qk_norm
    tol = dict(rtol=0, atol=0) if exact else tolerances(dtype)
    torch.testing.assert_close(out, expected, **tol)
    real = slots[slots >= 0]
    for layer_fused, layer_ref in zip(fused, two_kernels):
        flat_fused, flat_ref = layer_fused.flatten(0, 1), layer_ref.flatten(0, 1)
        torch.testing.assert_close(flat_fused[real], flat_ref[real], **tol)


# ---------------------------------------------------------------------- split combine in the O projection

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128)], ids=["gqa3-d64", "gqa4-d128"])
@pytest.mark.parametrize("seq_len,num_splits", [(70, 5), (37, 3), (200, 12)], ids=["5-of-5", "3-of-3", "7-of-12"])
@pytest.mark.parametrize("tiles", ["one-k-tile", "small-tiles"])
def test_combine_gemv_equals_the_combine_kernel_then_the_skinny_gemm(device, dtype, hq, hkv, d, seq_len, num_splits,
                                                                     tiles, monkeypatch):
    """The O projection merging the attention's partials itself: the combine kernel's row through
    ``gemv`` (one bfloat16 unit of the merged row at most apart: the splits sum in another order), and
    the float32 reference; with ``small-tiles`` several head tiles (K tiles) and split chunks."""
    from graphserving.runtime.model.kernels import o_proj, skinny_gemm

    if tiles == "small-tiles":
        monkeypatch.setattr(skinny_gemm, "MAX_BLOCK_K", 2 * d)  # two heads a K tile
        monkeypatch.setattr(o_proj, "PARTIAL_CHUNK_ELEMENTS", 2 * 2 * d)  # two splits a chunk: an online merge
    ctx = PagedContext([seq_len], hq, hkv, d, dtype, device, width=16)
    partials = ctx.kernel(num_splits=num_splits, defer_combine=True)
    assert isinstance(partials, kernels.DecodePartials) and partials.part_lse.shape == (1, hq, num_splits)
    gen = torch.Generator().manual_seed(5)
    weight = randn(40, hq * d, dtype=dtype, device=device, gen=gen, scale=0.1)
    bias = randn(40, dtype=dtype, device=device, gen=gen)
    out = kernels.combine_gemv(partials, weight, bias)
    merged = partials.combine(dtype)
    torch.testing.assert_close(merged, ctx.kernel(num_splits=num_splits).reshape(1, -1), rtol=0, atol=0)
    assert out.shape == (1, 40) and out.dtype == dtype
    torch.testing.assert_close(out, kernels.gemv(merged, weight, bias), **tolerances(dtype))
    reference = F.linear(ctx.reference().reshape(1, -1), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), reference, **(tolerances(dtype) if dtype == torch.float32
                                                          else dict(atol=5e-2, rtol=5e-2)))


@pytest.mark.parametrize("num_splits", [2, 5], ids=["narrow-chunk", "wide-chunk"])
def test_combine_gemv_with_more_rows_than_multiprocessors(device, num_splits):
    """Enough output rows that the programs take ONE_WAVE_BLOCK_N rows each (more than the device's
    multiprocessors would run at the default; the interpreter counts 4) and the last one is ragged,
    with a chunk of partials below and above WIDE_CHUNK_ELEMENTS: the row equals the combine
    kernel's row through ``gemv``."""
    from graphserving.runtime.model.kernels import o_proj
    from graphserving.runtime.model.kernels.backend import num_programs_target

    multiprocessors = num_programs_target(device) // 2
    rows = multiprocessors * o_proj.ONE_WAVE_BLOCK_N + 4
    assert o_proj.combine_gemv_rows(rows, 8 * 128, multiprocessors) == o_proj.ONE_WAVE_BLOCK_N
    assert o_proj.use_combine_gemv(num_splits, 8, 128, rows)  # the merging kernel, not the combine kernel first
    ctx = PagedContext([200], 8, 2, 128, torch.bfloat16, device, width=16)
    partials = ctx.kernel(num_splits=num_splits, defer_combine=True)
    gen = torch.Generator().manual_seed(7)
    weight = randn(rows, 8 * 128, dtype=torch.bfloat16, device=device, gen=gen, scale=0.1)
    out = kernels.combine_gemv(partials, weight)
    torch.testing.assert_close(out, kernels.gemv(partials.combine(torch.bfloat16), weight),
                               **tolerances(torch.bfloat16))


def test_combine_gemv_of_a_row_without_keys_is_the_bias(device):
    ctx = PagedContext([0], 4, 2, 64, torch.float32, device)
    ctx.block_table[0] = NULL_BLOCK  # NaN there: nothing may be read
    partials = ctx.kernel(num_splits=3, defer_combine=True)
    weight, bias = torch.ones(8, 256, device=device), torch.arange(8.0, device=device)
    torch.testing.assert_close(kernels.combine_gemv(partials, weight, bias), bias[None], rtol=0, atol=0)
    assert torch.equal(kernels.combine_gemv(partials, weight), torch.zeros(1, 8, device=device))


def test_decode_attention_defers_only_a_split_combine(monkeypatch):
    """One split writes the output directly (nothing to merge): a tensor even with defer_combine; with
    more splits the partials come back and no combine kernel runs."""
    from graphserving.runtime.model.kernels import decode_attention as module

    ctx = PagedContext([20], 4, 2, 64, torch.float32, "cpu")
    assert isinstance(ctx.kernel(num_splits=1, defer_combine=True), torch.Tensor)
    recorders = _record_launches(monkeypatch)
    ctx.kernel(num_splits=3, defer_combine=True)
    assert list(recorders) == [module._DECODE]


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(2, 4, 3, 64), torch.zeros(2, 4, 3)), "one row"),
    ((torch.zeros(1, 4, 3, 64), torch.zeros(1, 4, 2)), "one row"),
    ((torch.zeros(1, 4, 0, 64), torch.zeros(1, 4, 0)), "1 <= S"),  # no split: nothing to merge
    ((torch.zeros(1, 4, 64), torch.zeros(1, 4, 3)), r"part_out \[1, Hq, S, D\]"),
    ((torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 3)), "float32"),
])
def test_combine_gemv_rejects_partials_it_cannot_merge(args, message):
    with pytest.raises(ValueError, match=message):
        kernels.combine_gemv(kernels.DecodePartials(*args, torch.ones(1, dtype=torch.int32), 16), torch.zeros(8, 256))
    with pytest.raises(ValueError, match="context tile"):
        kernels.combine_gemv(kernels.DecodePartials(torch.zeros(1, 4, 3, 64), torch.zeros(1, 4, 3),
                                                    torch.ones(1, dtype=torch.int32), 24), torch.zeros(8, 256))


def test_combine_gemv_policy_bounds_the_partials_every_program_reads(monkeypatch):
    """Pure logic: the O projection merges the partials while its programs read at most
    COMBINE_MAX_PARTIAL_BYTES of them together, and never with the variable's 0. Its programs take
    more rows (up to ONE_WAVE_BLOCK_N) where there would be more of them than multiprocessors."""
    from graphserving.runtime.model.kernels import o_proj

    sms = 132  # H100 SXM and H200
    assert o_proj.combine_gemv_rows(576, 576, sms) == 8  # SmolLM2: 72 programs, one wave at the default
    assert o_proj.combine_gemv_rows(2048, 2048, sms) == 16  # Llama-3.2-1B: 256 programs of 8 become 128 of 16
    assert o_proj.combine_gemv_rows(2048, 2048, 1024) == 8
    assert o_proj.combine_gemv_rows(8192, 2048, sms) == o_proj.ONE_WAVE_BLOCK_N  # never more rows than that
    assert o_proj.use_combine_gemv(32, 9, 64, 576)  # SmolLM2, 32 splits: 72 programs of 8 rows, 5.3 MB
    assert o_proj.use_combine_gemv(5, 32, 64, 2048)  # Llama-3.2-1B, 5 splits: 256 programs of 8 rows, 10.5 MB
    assert not o_proj.use_combine_gemv(32, 32, 64, 2048)  # 67 MB: the combine kernel first
    assert not o_proj.use_combine_gemv(5, 32, 128, 2048)  # Qwen3-30B-A3B, 5 splits: 21 MB (counted at 8 rows)
    monkeypatch.setattr(o_proj, "COMBINE_IN_O_PROJ", False)
    assert not o_proj.use_combine_gemv(5, 9, 64, 576)


def test_combine_gemv_rejects_a_weight_of_another_width():
    partials = kernels.DecodePartials(torch.zeros(1, 4, 3, 64), torch.zeros(1, 4, 3), torch.ones(1), 16)
    with pytest.raises(ValueError, match=r"\[N, 256\]"):
        kernels.combine_gemv(partials, torch.zeros(8, 128))
    with pytest.raises(ValueError, match="bias"):
        kernels.combine_gemv(partials, torch.zeros(8, 256), torch.zeros(7))
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.combine_gemv(partials, torch.zeros(8, 256, dtype=torch.int32))
    with pytest.raises(ValueError, match="one device"):
        kernels.combine_gemv(partials, torch.zeros(8, 256), torch.zeros(8, device="meta"))


def test_combine_gemv_reads_a_strided_bias(device):
    """A bias view with a stride (as any ``[N]`` slice may be) gives what the skinny GEMM gives."""
    ctx = PagedContext([40], 4, 2, 64, torch.float32, device)
    partials = ctx.kernel(num_splits=3, defer_combine=True)
    gen = torch.Generator().manual_seed(2)
    weight = randn(8, 256, dtype=torch.float32, device=device, gen=gen)
    bias = torch.arange(16.0, device=device)[::2]
    torch.testing.assert_close(kernels.combine_gemv(partials, weight, bias),
                               kernels.gemv(partials.combine(torch.float32), weight, bias), **tolerances(torch.float32))


def test_paged_decode_attention_rejects_heads_that_do_not_group():
    q = torch.zeros(1, 6, 64)
    cache = torch.zeros(2, 16, 4, 64)
    with pytest.raises(ValueError, match="Hq=6 is not a multiple of Hkv=4"):
        kernels.paged_decode_attention(q, cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), 0.125)


def test_split_count_fills_the_device_and_depends_only_on_shapes():
    # batch 1 of an 8-KV-head model on 132 SMs (target 264 programs): capped at MAX_SPLITS
    assert choose_num_splits(1, 8, 8192, 64, 264) == MAX_SPLITS
    # 8 rows x 8 heads = 64 programs: ceil(264 / 64) = 5 splits
    assert choose_num_splits(8, 8, 8192, 64, 264) == 5
    # enough programs already: no split
    assert choose_num_splits(64, 8, 8192, 64, 264) == 1
    # never more splits than tiles the table can hold (2 tiles of 64 in 128 tokens)
    assert choose_num_splits(1, 1, 128, 64, 264) == 2


# ---------------------------------------------------------------------- the switch

def test_kernels_are_never_chosen_for_the_cpu(monkeypatch):
    monkeypatch.delenv(backend.KERNELS_ENV, raising=False)
    assert kernels.available("cpu") is False


def test_env_var_torch_forces_the_reference_path(monkeypatch):
    monkeypatch.setenv(backend.KERNELS_ENV, "torch")
    assert kernels.available("cuda") is False


def test_env_var_with_an_unknown_value_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(backend.KERNELS_ENV, "cutlass")
    with pytest.raises(ValueError, match="GRAPHSERVING_KERNELS='cutlass'.*triton, torch"):
        kernels.requested_path()


# ---------------------------------------------------------------------- the model on both paths

def tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_ids=(2,))


def run_steps(model, paged_runner, steps):
    runner = paged_runner(model, num_blocks=24, block_size=16, table_width=8, seed=3)
    return [runner.step(batch, pad_reqs=pad) for batch, pad in steps]


STEPS = [
    ([("a", list(range(1, 20))), ("b", [5, 6, 7])], 0),  # prefill of two prompts
    ([("a", [9]), ("b", [11])], 2),  # uniform decode with two padded rows
    ([("c", list(range(30, 52))), ("a", [3])], 0),  # mixed: a prefill and a decode row
    ([("a", [4]), ("b", [12]), ("c", [13])], 0),
]


def count_norm_linear_calls(monkeypatch, path: str) -> list:
    """Force one projection path: ``"norm-linear"`` (``fused_add_rms_norm_linear`` at every token
    count), ``"gemv"`` (the skinny GEMM for steps of at most ``MAX_ROWS`` rows, cuBLAS above) or
    ``"unfused"`` (norm then cuBLAS). The returned list collects each fused norm + projection
    call's activation (to check that the model took the path under test)."""
    from graphserving.runtime.model.kernels import skinny_gemm

    calls: list = []
    for name in ("fused_add_rms_norm_linear", "fused_add_rms_norm_gemv"):
        real = getattr(kernels, name)

        def spy(*args, real=real, **kwargs):
            calls.append(kwargs.get("activation"))
            return real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, spy)
    monkeypatch.setattr(kernels, "use_fused_norm_linear", lambda tokens, hidden, out_features: path == "norm-linear")
    monkeypatch.setattr(skinny_gemm, "GEMV_MAX_TOKENS", skinny_gemm.MAX_ROWS if path == "gemv" else 0)
    return calls


NORM_LINEAR_PATHS = [pytest.param("norm-linear", id="norm-linear-fused"), pytest.param("gemv", id="skinny-gemm"),
                     pytest.param("unfused", id="norm-then-gemm")]


def expected_norm_linear_calls(model, steps, path: str) -> list:
    """Per step: one norm+QKV per layer, one add+norm+gate/up+SwiGLU per layer (the skinny GEMM
    only in steps of at most MAX_ROWS token rows, padding included)."""
    from graphserving.runtime.model.kernels.skinny_gemm import MAX_ROWS

    per_step = [None] + ["silu_and_mul", None] * (model.num_layers - 1) + ["silu_and_mul"]
    rows = [sum(len(tokens) for _, tokens in batch) + pad for batch, pad in steps]
    return {"norm-linear": per_step * len(steps), "unfused": [],
            "gemv": per_step * sum(r <= MAX_ROWS for r in rows)}[path]


@pytest.mark.slow
@pytest.mark.parametrize("norm_linear", NORM_LINEAR_PATHS)
def test_fused_model_path_gives_the_reference_logits(device, paged_runner, monkeypatch, norm_linear):
    model = random_model(tiny_config(), torch.float32, device, max_positions=128, seed=7)
    monkeypatch.setenv(backend.KERNELS_ENV, "torch")
    reference = run_steps(model, paged_runner, STEPS)
    monkeypatch.delenv(backend.KERNELS_ENV)
    # The CPU reaches the kernels only through the interpreter, which `available` never picks.
    monkeypatch.setattr(kernels, "available", lambda dev: True)
    calls = count_norm_linear_calls(monkeypatch, norm_linear)
    assert model.uses_kernels()
    fused = run_steps(model, paged_runner, STEPS)
    for ours, ref in zip(fused, reference):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert calls == expected_norm_linear_calls(model, STEPS, norm_linear)


@pytest.mark.slow
def test_the_model_sends_every_projection_but_qkv_to_the_skinny_gemm_of_a_wide_hidden_size(device, paged_runner,
                                                                                             monkeypatch):
    """A hidden size above the plain bound but among the wide sizes of the weights' device (a stand-in
    for ``WIDE_HIDDEN_DEVICES``' entry): the one-row steps run O, gate/up + SwiGLU, down and the LM head
    on the skinny GEMM and QKV on norm + cuBLAS, with the reference logits; without it, none."""
    from graphserving.runtime.model.kernels import skinny_gemm

    model = random_model(tiny_config(), torch.float32, device, max_positions=128, seed=7)
    steps = [([("a", list(range(1, 20)))], 0), ([("a", [9])], 0), ([("a", [4]), ("b", [12])], 0)]
    monkeypatch.setenv(backend.KERNELS_ENV, "torch")
    reference = run_steps(model, paged_runner, steps)
    monkeypatch.delenv(backend.KERNELS_ENV)
    monkeypatch.setattr(kernels, "available", lambda dev: True)
    monkeypatch.setattr(kernels, "use_fused_norm_linear", lambda tokens, hidden, out_features: False)
    monkeypatch.setattr(skinny_gemm, "GEMV_MAX_HIDDEN", model.config.hidden_size // 2)
    for name in (skinny_gemm.GEMV_ENV, skinny_gemm.GEMV_HIDDEN_ENV, skinny_gemm.GEMV_TOKENS_ENV):
        monkeypatch.delenv(name, raising=False)
    wide = {model.config.hidden_size}
    monkeypatch.setattr(skinny_gemm, "wide_hidden_sizes", lambda dev: frozenset(
        wide if dev is not None and torch.device(dev).type == torch.device(device).type else ()))
    normed, plain = [], []
    for name, log, key in (("fused_add_rms_norm_gemv", normed, lambda a, kw: kw.get("activation")),
                           ("gemv", plain, lambda a, kw: tuple(a[1].shape)),
                           ("combine_gemv", plain, lambda a, kw: tuple(a[1].shape))):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, log=log, key=key, **kw:
                            log.append(key(a, kw)) or real(*a, **kw))
    fused = run_steps(model, paged_runner, steps)
    for ours, ref in zip(fused, reference):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    layers = model.num_layers
    assert normed == ["silu_and_mul"] * layers  # the one-row decode step's gate/up; never QKV
    o, down, head = (tuple(w.shape) for w in (model.layers[0].o_proj, model.layers[0].down_proj, model.lm_head))
    assert sorted(plain) == sorted([head] + [o, down] * layers + [head])  # the prefill's one logits row too
    normed.clear(), plain.clear(), wide.clear()
    run_steps(model, paged_runner, steps)
    assert normed == [] and plain == []


def tiny_qwen3_moe_config() -> ModelConfig:
    """Qwen3-MoE in miniature: q/k norms on heads of 128, a dense layer then a mixture-of-experts
    layer."""
    return ModelConfig(architecture="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_ids=(2,),
                       qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, moe_layers=(1,))


def _count_qk_norm_kernels(monkeypatch) -> list[tuple[str, bool]]:
    """Record each launch of a kernel that applies RoPE (``rope_and_write_kv``,
    ``rope_write_and_decode_attention``): its name and whether it was given the q/k norm."""
    seen: list[tuple[str, bool]] = []
    for name in ("rope_and_write_kv", "rope_write_and_decode_attention"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name, **kw:
                            seen.append((name, kw.get("qk_norm") is not None)) or real(*a, **kw))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("fuse_rope, route_in_router", [("0", "0"), ("1", "0"), ("1", "1")],
                         ids=["rope-kernel", "rope-in-attention", "route-in-router"])
def test_fused_qwen3_moe_path_folds_its_norms_and_gives_the_reference_logits(device, paged_runner, monkeypatch,
                                                                              fuse_rope, route_in_router):
    """The q/k norm inside the kernel that applies RoPE (the RoPE kernel, or with the fused
    RoPE-decode kernel on, the decode attention kernel in decode steps) and, in steps of the skinny
    GEMM, the MoE layer's norm inside the router projection (return_normed), with
    ``GRAPHSERVING_MOE_ROUTE_IN_ROUTER=1`` the routing too (no route kernel in those steps): the
    reference's logits."""
    from graphserving.runtime.model.kernels import decode_attention
    from graphserving.runtime.model.kernels import moe as kernels_moe

    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", fuse_rope)
    monkeypatch.setattr(kernels_moe, "ROUTE_IN_ROUTER", route_in_router)
    model = random_model(tiny_qwen3_moe_config(), torch.float32, device, max_positions=128, seed=9)
    with torch.no_grad():
        for layer in model.layers:
            layer.q_norm.uniform_(0.5, 1.5)
            layer.k_norm.uniform_(0.5, 1.5)
    monkeypatch.setenv(backend.KERNELS_ENV, "torch")
    reference = run_steps(model, paged_runner, STEPS)
    monkeypatch.delenv(backend.KERNELS_ENV)
    monkeypatch.setattr(kernels, "available", lambda dev: True)
    count_norm_linear_calls(monkeypatch, "gemv")
    launches: list = []
    real_gemv = kernels.fused_add_rms_norm_gemv
    monkeypatch.setattr(kernels, "fused_add_rms_norm_gemv",
                        lambda *a, **kw: launches.append(kw.get("return_normed", False)) or real_gemv(*a, **kw))
    routed_in_router, route_kernels = [], []
    real_route, real_topk = kernels.fused_add_rms_norm_gemv_route, kernels.fused_route_topk
    monkeypatch.setattr(kernels, "fused_add_rms_norm_gemv_route",
                        lambda *a, **kw: routed_in_router.append(kw["ticket"]) or real_route(*a, **kw))
    monkeypatch.setattr(kernels, "fused_route_topk", lambda *a, **kw: route_kernels.append(1) or real_topk(*a, **kw))
    qk_norms = _count_qk_norm_kernels(monkeypatch)
    fused = run_steps(model, paged_runner, STEPS)
    for ours, ref in zip(fused, reference):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # the two steps of at most 8 rows (4 and 3): the router on the skinny GEMM, routing in it or not
    assert (len(routed_in_router), launches.count(True)) == ((2, 0) if route_in_router == "1" else (0, 2))
    assert len(route_kernels) == len(STEPS) - len(routed_in_router)
    assert all(ticket is model.layers[1].route_ticket and ticket.item() == 0 for ticket in routed_in_router)
    # every attention that applied RoPE applied the q/k norm: the RoPE kernel, or with
    # GRAPHSERVING_FUSE_ROPE_DECODE=1 the decode attention kernel in the steps of one token a row
    assert qk_norms and all(given for _, given in qk_norms)
    in_attention = sum(name == "rope_write_and_decode_attention" for name, _ in qk_norms)
    assert in_attention == (2 * 2 if fuse_rope == "1" else 0)  # two decode steps, two layers


@pytest.mark.slow
@pytest.mark.parametrize("norm_linear", NORM_LINEAR_PATHS)
def test_fused_forward_is_the_composition_of_its_segments(device, paged_runner, monkeypatch, norm_linear):
    monkeypatch.setattr(kernels, "available", lambda dev: True)
    calls = count_norm_linear_calls(monkeypatch, norm_linear)
    model = random_model(tiny_config(), torch.float32, device, max_positions=128, seed=8)
    whole = paged_runner(model, num_blocks=16, block_size=16, table_width=4, seed=1)
    parts = paged_runner(model, num_blocks=16, block_size=16, table_width=4, seed=1)
    batch = [("a", [1, 2, 3, 4, 5])]
    meta = whole.metadata(batch)
    with torch.inference_mode():
        expected = model(meta, whole.kv_caches)
        meta = parts.metadata(batch)
        outs = model.run_segment(0, meta.input_ids, meta.positions, None, None)
        for i in range(model.num_layers):
            q, k, v, residual = outs
            attn = model.run_attention(i, q, k, v, meta, parts.kv_caches[i])
            outs = model.run_segment(i + 1, meta.input_ids, meta.positions, attn, residual)
    assert torch.equal(outs[0], expected)
    # 2 per layer, forward + segments (5 rows: the skinny GEMM takes them too)
    assert len(calls) == (0 if norm_linear == "unfused" else 4 * model.num_layers)


# ---------------------------------------------------------------------- CUDA graphs (GPU only)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_attention_replays_in_a_cuda_graph_with_new_contents():
    contexts = [PagedContext(lens, 8, 2, 128, torch.bfloat16, "cuda", width=512, seed=seed)
                for seed, lens in enumerate([[40, 3, 0], [7, 65, 20], [300, 1, 129]])]
    num_blocks = max(ctx.k_cache.shape[0] for ctx in contexts)
    q = torch.zeros_like(contexts[0].q)
    k_cache = torch.full((num_blocks, *contexts[0].k_cache.shape[1:]), float("nan"), dtype=torch.bfloat16,
                         device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    block_table = torch.zeros_like(contexts[0].block_table)
    seq_lens = torch.zeros_like(contexts[0].seq_lens)
    scale = 128 ** -0.5

    def run():
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for ctx in contexts:
        q.copy_(ctx.q)
        block_table.copy_(ctx.block_table)
        seq_lens.copy_(ctx.seq_lens)
        k_cache[: ctx.k_cache.shape[0]].copy_(ctx.k_cache)
        v_cache[: ctx.v_cache.shape[0]].copy_(ctx.v_cache)
        graph.replay()
        torch.testing.assert_close(out, ctx.kernel(), atol=0, rtol=0)


# ---------------------------------------------------------------------- compiling for the GPU

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64"}


class _Recorder:
    """Stands in for a launchable kernel: records each launch's arguments instead of running."""

    def __init__(self):
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _record_launches(monkeypatch) -> dict:
    """Every ``DeviceKernel.on`` returns its kernel's :class:`_Recorder`: {kernel: recorder}."""
    recorders: dict = {}
    monkeypatch.setattr(backend.DeviceKernel, "on",
                        lambda self, device, tokens=None: recorders.setdefault(self, _Recorder()))
    return recorders


def _launch_every_kernel(dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, inter: int) -> None:
    t, blocks, block_size = 2, 4, 16
    x = torch.zeros(t, hidden, dtype=dtype)
    kernels.fused_add_rms_norm(x, x, torch.ones(hidden, dtype=dtype), 1e-5)
    kernels.rms_norm(x, torch.ones(hidden, dtype=dtype), 1e-5)
    kernels.silu_and_mul(torch.zeros(t, 2 * inter, dtype=dtype))
    q, k, v = qkv_views(torch.zeros(t, (hq + 2 * hkv) * d, dtype=dtype), hq, hkv, d)
    cache = torch.zeros(2, blocks, block_size, hkv, d, dtype=dtype)
    cos = torch.zeros(8, d, dtype=dtype)
    qk_norms = (None, (torch.ones(d, dtype=dtype), torch.ones(d, dtype=dtype), 1e-6))  # Qwen3's q/k norm folded in
    for return_k, qk_norm in itertools.product((True, False), qk_norms):
        kernels.rope_and_write_kv(q, k, v, torch.zeros(t, dtype=torch.int64), cos, cos, cache,
                                  torch.zeros(t, dtype=torch.int64), return_k=return_k, qk_norm=qk_norm)
    for num_splits in (1, 2):  # the single-split variant writes the output directly
        for prefetch in (False, True):
            kernels.paged_decode_attention(q.contiguous(), cache[0], cache[1], torch.zeros(t, 3, dtype=torch.int32),
                                           torch.ones(t, dtype=torch.int32), d ** -0.5, num_splits=num_splits,
                                           prefetch=prefetch)
        for qk_norm in qk_norms:
            kernels.rope_write_and_decode_attention(
                q, k, v, torch.zeros(t, dtype=torch.int64), cos, cos, cache, torch.zeros(t, dtype=torch.int64),
                torch.zeros(t, 3, dtype=torch.int32), torch.ones(t, dtype=torch.int32), d ** -0.5,
                num_splits=num_splits, qk_norm=qk_norm)
    # Weights as broadcast rows (stride 0): the launch sees full shapes without allocating them.
    qkv_weight = torch.zeros(1, hidden, dtype=dtype).expand((hq + 2 * hkv) * d, hidden)
    gate_up_weight = torch.zeros(1, hidden, dtype=dtype).expand(2 * inter, hidden)
    norm = torch.ones(hidden, dtype=dtype)
    kernels.fused_add_rms_norm_linear(x, None, norm, qkv_weight, torch.zeros(qkv_weight.shape[0], dtype=dtype), 1e-5)
    kernels.fused_add_rms_norm_linear(x, x, norm, gate_up_weight, None, 1e-5, activation="silu_and_mul")
    down_weight = torch.zeros(1, inter, dtype=dtype).expand(hidden, inter)
    for rows in (1, 8):  # the skinny GEMM's row blocks at both ends
        xr = torch.zeros(rows, hidden, dtype=dtype)
        kernels.fused_add_rms_norm_gemv(xr, None, norm, qkv_weight, torch.zeros(qkv_weight.shape[0], dtype=dtype),
                                        1e-5)
        kernels.fused_add_rms_norm_gemv(xr, xr, norm, gate_up_weight, None, 1e-5, activation="silu_and_mul")
        kernels.gemv(torch.zeros(rows, inter, dtype=dtype), down_weight)
        kernels.gemv(xr, qkv_weight, out_dtype=torch.float32)  # the LM head's float32 logits
    o_weight = torch.zeros(1, hq * d, dtype=dtype).expand(hidden, hq * d)
    for num_splits in (5, 32):  # the O projection merging one row's partials: one chunk, several
        kernels.combine_gemv(kernels.DecodePartials(torch.zeros(1, hq, num_splits, d), torch.zeros(1, hq, num_splits),
                                                    torch.ones(1, dtype=torch.int32), 64), o_weight)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    pytest.param(dict(dtype=torch.bfloat16, hq=9, hkv=3, d=64, hidden=576, inter=1536), id="smollm2-bf16"),
    pytest.param(dict(dtype=torch.bfloat16, hq=32, hkv=8, d=128, hidden=4096, inter=14336), id="llama3-8b-bf16"),
    pytest.param(dict(dtype=torch.float32, hq=6, hkv=2, d=64, hidden=64, inter=96), id="tiny-fp32"),
])
def test_every_kernel_compiles_for_hopper(shape, monkeypatch):
    """Each launch the wrappers make compiles to sm_90 machine code (no GPU needed: Triton's
    bundled ptxas), catching code-generation errors that the interpreter cannot see."""
    compiler = pytest.importorskip("triton.compiler")
    targets = pytest.importorskip("triton.backends.compiler")
    if not hasattr(compiler, "ASTSource") or not hasattr(targets, "GPUTarget"):
        pytest.skip("this Triton has no ASTSource/GPUTarget compile API")
    import triton

    from graphserving.runtime.model.kernels import o_proj

    monkeypatch.setattr(o_proj, "COMBINE_MAX_PARTIAL_BYTES", 1 << 40)  # the merging kernel at every shape
    recorders = _record_launches(monkeypatch)
    _launch_every_kernel(**shape)
    assert len(recorders) == 8
    for kernel, recorder in recorders.items():
        jit_fn = triton.jit(kernel.fn, **kernel.jit_options)
        names = list(inspect.signature(kernel.fn).parameters)
        for args, kwargs in recorder.launches:
            signature = {}
            for name, arg in zip(names, args):
                if isinstance(arg, torch.Tensor):
                    signature[name] = "*" + _TYPES[arg.dtype]
                elif isinstance(arg, float):
                    signature[name] = "fp32"
                else:
                    signature[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
            options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
            # A PDL kernel compiles both ways: with griddepcontrol (the launcher's USE_PDL=True on
            # Hopper) and without it.
            for constexprs in ([{**kwargs, "USE_PDL": use} for use in (False, True)] if kernel.pdl else [kwargs]):
                signature.update({name: "constexpr" for name in constexprs})
                source = compiler.ASTSource(jit_fn, signature, constexprs=constexprs)
                compiled = triton.compile(source, target=targets.GPUTarget("cuda", 90, 32), options=options)
                assert compiled.asm["cubin"], f"{kernel.__name__} produced no machine code"
                if constexprs.get("USE_PDL"):
                    assert "griddepcontrol.wait" in compiled.asm["ptx"], f"{kernel.__name__}: no PDL wait"


def test_fused_rope_decode_policy_by_head_dimension_and_the_variable_is_checked(monkeypatch):
    """``auto`` fuses head dimensions up to FUSED_ROPE_MAX_HEAD_DIM (128) only; ``1`` and ``0``
    override; any other value is an error that names the variable."""
    from graphserving.runtime.model.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "auto")
    assert kernels.use_fused_rope_decode(64) and kernels.use_fused_rope_decode(128)
    assert not kernels.use_fused_rope_decode(256)
    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "1")
    assert kernels.use_fused_rope_decode(256)
    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "0")
    assert not kernels.use_fused_rope_decode(64)
    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "yes")
    with pytest.raises(ValueError, match="GRAPHSERVING_FUSE_ROPE_DECODE"):
        kernels.use_fused_rope_decode(64)


def test_pdl_is_on_for_small_batches_only_and_the_variable_is_checked(monkeypatch):
    """The launch policy (pure logic; the device support check stubbed): PDL for batches of at most
    PDL_MAX_TOKENS rows on a supporting CUDA device, ``all`` for every batch, ``0`` never, never on
    the CPU, and an unknown value of the variable is an error that names it."""
    monkeypatch.setattr(backend, "_pdl_supported", lambda index: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(backend.PDL_ENV, raising=False)
    assert backend.pdl_enabled(cuda, 1) and backend.pdl_enabled(cuda, backend.PDL_MAX_TOKENS)
    assert not backend.pdl_enabled(cuda, backend.PDL_MAX_TOKENS + 1)
    assert not backend.pdl_enabled(torch.device("cpu"), 1)
    monkeypatch.setenv(backend.PDL_ENV, "all")
    assert backend.pdl_enabled(cuda, 256)
    monkeypatch.setenv(backend.PDL_ENV, "0")
    assert not backend.pdl_enabled(cuda, 1)
    monkeypatch.setenv(backend.PDL_ENV, "yes")
    with pytest.raises(ValueError, match=backend.PDL_ENV):
        backend.pdl_enabled(cuda, 1)
    monkeypatch.setattr(backend, "_pdl_supported", lambda index: False)
    monkeypatch.setenv(backend.PDL_ENV, "all")
    assert not backend.pdl_enabled(cuda, 1)


def _tiny_model_on_the_kernels(monkeypatch):
    """A two-layer Llama of random weights whose every kernel runs (through the interpreter on CPU),
    the attention of the unfused path too."""
    from graphserving.runtime.model.config import ModelConfig
    from graphserving.runtime.model.llama import LlamaForCausalLM

    config = ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    })
    model = LlamaForCausalLM(config, device="cpu")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    monkeypatch.setattr(LlamaForCausalLM, "uses_kernels", lambda self: True)
    monkeypatch.setattr(kernels, "available", lambda device: True)
    return model


def test_fused_rope_decode_attention_in_the_model_equals_the_two_kernel_path(paged_runner, monkeypatch):
    """The model's uniform-decode attention with ``kernels.use_fused_rope_decode`` on (every kernel through
    the interpreter on CPU): the same logits and the same KV cache as without it, a padded row
    included."""
    from graphserving.runtime.model.kernels import decode_attention

    model = _tiny_model_on_the_kernels(monkeypatch)
    runners = [paged_runner(model), paged_runner(model)]
    for runner in runners:
        runner.step([("x", [1, 2, 3]), ("y", [4, 5])])
    logits = []
    for fuse, runner in zip((False, True), runners):
        monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "1" if fuse else "0")
        logits.append(runner.step([("x", [6]), ("y", [7])], pad_reqs=1))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    for fused, unfused in zip(runners[1].kv_caches, runners[0].kv_caches):
        torch.testing.assert_close(fused[:, NULL_BLOCK + 1:], unfused[:, NULL_BLOCK + 1:], rtol=0, atol=0)


@pytest.mark.parametrize("fuse_rope", ["1", "0"], ids=["rope-in-attention", "rope-kernel"])
def test_one_row_decode_merges_the_attention_partials_in_the_o_projection(paged_runner, monkeypatch, fuse_rope):
    """A one-row decode step of a tiny model (every kernel through the interpreter on CPU): the O
    projection merges the attention's partials (``kernels.combine_gemv``, once per layer), and the
    logits equal those with the combine kernel (``GRAPHSERVING_COMBINE_IN_O_PROJ=0``) within float32
    rounding."""
    from graphserving.runtime.model.kernels import decode_attention, o_proj

    model = _tiny_model_on_the_kernels(monkeypatch)
    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", fuse_rope)
    decisions = []
    monkeypatch.setattr(o_proj, "use_combine_gemv", lambda *shape: decisions.append(o_proj.COMBINE_IN_O_PROJ)
                        or o_proj.COMBINE_IN_O_PROJ)
    runners = [paged_runner(model), paged_runner(model)]
    for runner in runners:
        runner.step([("x", list(range(1, 40)))])
    logits = []
    for merge, runner in zip((False, True), runners):
        monkeypatch.setattr(o_proj, "COMBINE_IN_O_PROJ", merge)
        logits.append(runner.step([("x", [6])]))
    layers = model.config.num_hidden_layers
    assert decisions == [False] * layers + [True] * layers
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
