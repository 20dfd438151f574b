"""advance_decode: the one-launch kernel against the torch reference (CPU through Triton's
interpreter, and compiled on CUDA), every field compared exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from graphserving.runtime.engine.decode_advance import advance_decode, advance_decode_reference  # noqa: E402
from graphserving.runtime.engine.decode_advance_kernel import launch_advance_decode  # noqa: E402
from graphserving.runtime.model.forward_metadata import ForwardMetadata  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID  # noqa: E402

FIELDS = ("input_ids", "positions", "seq_lens", "slot_mapping", "block_table")


def decode_batch(num_reqs: int, padded: int, block_size: int, width: int, seed: int, device: str = "cpu"):
    """A uniform-decode batch of ``num_reqs`` real rows padded to ``padded`` rows, as a FULL key's
    static buffers hold it (block table wider than any row needs), and the tokens sampled for it."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, block_size * (width - 1), (num_reqs,), generator=g)
    table = torch.full((padded, width + 3), NULL_BLOCK, dtype=torch.int32)
    table[:num_reqs, :width] = torch.randint(1, 1000, (num_reqs, width), generator=g, dtype=torch.int32)
    pad = padded - num_reqs
    meta = ForwardMetadata(
        input_ids=torch.cat([torch.randint(0, 5000, (num_reqs,), generator=g), torch.zeros(pad, dtype=torch.int64)]),
        positions=torch.cat([positions, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.cat([positions + 1, torch.zeros(pad, dtype=torch.int64)]).to(torch.int32),
        query_lens=torch.ones(padded, dtype=torch.int32), query_start_loc=torch.arange(padded + 1, dtype=torch.int32),
        block_table=table[:, :width + 3],
        slot_mapping=torch.cat([torch.randint(0, 9999, (num_reqs,), generator=g),
                                torch.full((pad,), PAD_SLOT_ID, dtype=torch.int64)]),
        logits_indices=torch.arange(padded), num_actual_tokens=padded, num_actual_reqs=padded, max_query_len=1,
    )
    tokens = torch.randint(0, 5000, (num_reqs,), generator=g)
    live = (torch.rand(num_reqs, generator=g) < 0.7).to(torch.int64)
    steps = torch.randint(0, 100, (num_reqs,), generator=g)
    return meta.to(device), tokens.to(device), live.to(device), steps.to(device)


@pytest.mark.parametrize("num_reqs, padded", [(1, 1), (3, 4), (17, 32), (40, 40), (130, 136)])
@pytest.mark.parametrize("with_live", [False, True])
def test_the_kernel_equals_the_reference_exactly(num_reqs, padded, with_live):
    block_size, width = 4, 6
    meta, tokens, live, steps = decode_batch(num_reqs, padded, block_size, width, seed=num_reqs * 7 + with_live)
    ref, ref_steps = meta.clone(), steps.clone()
    advance_decode_reference(ref, tokens, num_reqs, block_size, live if with_live else None, steps=ref_steps)
    launch_advance_decode(meta, tokens, num_reqs, block_size, live if with_live else None, steps)
    for name in FIELDS:
        assert torch.equal(getattr(meta, name), getattr(ref, name)), name
    assert torch.equal(steps, ref_steps)
    # the padded rows kept their sentinels; real rows moved one position on (live ones)
    assert meta.slot_mapping[num_reqs:].eq(PAD_SLOT_ID).all()
    moved = live if with_live else torch.ones_like(live)
    assert torch.equal(meta.positions[:num_reqs], ref.positions[:num_reqs])
    assert torch.equal(meta.input_ids[:num_reqs], tokens * moved)


def test_the_kernel_gives_a_position_beyond_the_block_table_no_slot():
    block_size = 4
    meta, tokens, _, _ = decode_batch(2, 2, block_size, width=2, seed=3)
    meta.positions[:] = torch.tensor([block_size * 2 - 1, 2])  # row 0 moves to column 2, past the width
    narrow = replace(meta, block_table=meta.block_table[:, :2].contiguous())
    launch_advance_decode(narrow, tokens, 2, block_size, None, None)
    assert narrow.slot_mapping[0].item() == PAD_SLOT_ID
    assert narrow.slot_mapping[1].item() == narrow.block_table[1, 0].item() * block_size + 3


def test_the_kernel_rejects_a_strided_row_tensor():
    meta, tokens, _, _ = decode_batch(4, 4, 4, 6, seed=5)
    with pytest.raises(ValueError, match="contiguous"):
        launch_advance_decode(meta, torch.stack([tokens, tokens], 1)[:, 0], 4, 4, None, None)


def test_no_rows_is_nothing_to_do():
    meta, tokens, _, _ = decode_batch(2, 2, 4, 6, seed=9)
    before = meta.clone()
    advance_decode(meta, tokens[:0], 0, 4)
    assert all(torch.equal(getattr(meta, n), getattr(before, n)) for n in FIELDS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_reqs, padded", [(1, 1), (5, 8), (64, 64), (200, 256)])
def test_on_cuda_advance_decode_runs_the_kernel_and_equals_the_reference(num_reqs, padded):
    block_size, width = 16, 9
    meta, tokens, live, steps = decode_batch(num_reqs, padded, block_size, width, seed=num_reqs, device="cuda")
    for use_live in (None, live):
        ref, ref_steps = meta.clone(), steps.clone()
        advance_decode_reference(ref, tokens, num_reqs, block_size, use_live, steps=ref_steps)
        advance_decode(meta, tokens, num_reqs, block_size, use_live, steps=steps)
        for name in FIELDS:
            assert torch.equal(getattr(meta, name), getattr(ref, name)), name
        assert torch.equal(steps, ref_steps)


@pytest.mark.parametrize("has_live, has_steps", [(False, False), (True, True)])
def test_the_kernel_compiles_for_hopper(has_live, has_steps):
    """sm_90 machine code from Triton's bundled ptxas (no GPU needed): code-generation errors the
    interpreter cannot see."""
    compiler = pytest.importorskip("triton.compiler")
    targets = pytest.importorskip("triton.backends.compiler")
    if not hasattr(compiler, "ASTSource") or not hasattr(targets, "GPUTarget"):
        pytest.skip("this Triton has no ASTSource/GPUTarget compile API")
    import triton

    from graphserving.runtime.engine import decode_advance_kernel as k

    pointers = {"input_ids_ptr": "*i64", "positions_ptr": "*i64", "seq_lens_ptr": "*i32", "slots_ptr": "*i64",
                "table_ptr": "*i32", "tokens_ptr": "*i64", "live_ptr": "*i64", "steps_ptr": "*i64"}
    constexprs = {"BLOCK_SIZE": 16, "ROWS": k.ROWS, "HAS_LIVE": has_live, "HAS_STEPS": has_steps, "PAD_SLOT": PAD_SLOT_ID}
    signature = {**pointers, "num_reqs": "i32", "stride_t": "i32", "table_width": "i32",
                 **{name: "constexpr" for name in constexprs}}
    source = compiler.ASTSource(triton.jit(k._advance_decode_kernel), signature, constexprs=constexprs)
    compiled = triton.compile(source, target=targets.GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]
