"""Static buffers: every replay rewrites every row of the key; padded rows get their sentinels."""

import pytest
import torch

from graphserving.runtime.model.forward_metadata import ForwardMetadata

from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from graphserving.runtime.graphs.static_buffers import StaticBuffers


def decode_meta(n, width=3):
    i32, i64 = torch.int32, torch.int64
    return ForwardMetadata(
        input_ids=torch.arange(100, 100 + n, dtype=i64),
        positions=torch.arange(n, dtype=i64) + 5,
        seq_lens=torch.arange(n, dtype=i32) + 6,
        query_lens=torch.ones(n, dtype=i32),
        query_start_loc=torch.arange(n + 1, dtype=i32),
        block_table=torch.arange(n * width, dtype=i32).reshape(n, width) + 1,
        slot_mapping=torch.arange(n, dtype=i64) * 16 + 21,
        logits_indices=torch.arange(n, dtype=i64),
        num_actual_tokens=n, num_actual_reqs=n, max_query_len=1,
    )


def test_padded_rows_get_sentinels_after_poisoning():
    bufs = StaticBuffers(max_tokens=32, max_reqs=32, max_blocks_per_seq=8, device=torch.device("cpu"))
    bufs.poison(torch.Generator().manual_seed(0))
    view = bufs.fill_full(decode_meta(19), 24)
    assert view.num_tokens == 24 and view.num_reqs == 24
    assert view.input_ids[:19].tolist() == list(range(100, 119))
    assert (view.input_ids[19:] == 0).all() and (view.positions[19:] == 0).all()
    assert (view.slot_mapping[19:] == PAD_SLOT_ID).all()
    assert (view.seq_lens[19:] == 0).all()
    assert view.query_start_loc.tolist() == list(range(25))
    assert (view.block_table[:19, 3:] == NULL_BLOCK).all()
    assert (view.block_table[19:] == NULL_BLOCK).all()
    assert view.logits_indices.tolist() == list(range(24))


def test_smaller_batch_after_larger_leaves_nothing_stale():
    bufs = StaticBuffers(max_tokens=32, max_reqs=32, max_blocks_per_seq=8, device=torch.device("cpu"))
    bufs.fill_full(decode_meta(32, width=8), 32)
    view = bufs.fill_full(decode_meta(19, width=2), 24)
    assert (view.block_table[:19, 2:] == NULL_BLOCK).all()
    assert (view.seq_lens[19:] == 0).all()
    assert (bufs["slot_mapping"][19:24] == PAD_SLOT_ID).all()


def test_piecewise_fill_keeps_request_tensors_and_pads_tokens():
    bufs = StaticBuffers(max_tokens=64, max_reqs=8, max_blocks_per_seq=8, device=torch.device("cpu"))
    bufs.poison()
    meta = decode_meta(5)
    view = bufs.fill_piecewise(meta, 8)
    assert view.num_tokens == 8
    assert (view.slot_mapping[5:] == PAD_SLOT_ID).all()
    assert view.seq_lens is meta.seq_lens


def test_addresses_are_stable_across_fills():
    bufs = StaticBuffers(max_tokens=32, max_reqs=32, max_blocks_per_seq=8, device=torch.device("cpu"))
    before = bufs.data_ptrs()
    bufs.fill_full(decode_meta(7), 8)
    bufs.fill_piecewise(decode_meta(3), 4)
    assert bufs.data_ptrs() == before


def test_a_keys_view_is_built_once_and_sees_every_fill():
    bufs = StaticBuffers(max_tokens=32, max_reqs=32, max_blocks_per_seq=8, device=torch.device("cpu"))
    first = bufs.fill_full(decode_meta(3), 4)
    second = bufs.fill_full(decode_meta(2), 4)
    assert second is first and bufs.full_view(4) is first
    assert first.input_ids.tolist() == [100, 101, 0, 0]
    assert bufs.full_view(8) is not first and bufs.full_view(8).num_reqs == 8


FIELDS = ("input_ids", "positions", "seq_lens", "query_lens", "query_start_loc", "block_table", "slot_mapping",
          "logits_indices")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_fills_staged_to_cuda_equal_the_same_fills_in_place():
    """Host metadata goes through the pinned staging pack and one copy of its prefix up to the key's
    last block-table row; a small key after a large one must still read exactly its own rows."""
    cuda = StaticBuffers(max_tokens=64, max_reqs=64, max_blocks_per_seq=16, device=torch.device("cuda"))
    cpu = StaticBuffers(max_tokens=64, max_reqs=64, max_blocks_per_seq=16, device=torch.device("cpu"))
    cuda.poison(torch.Generator().manual_seed(1))
    for n, key, width in ((64, 64, 16), (1, 1, 3), (5, 8, 16), (1, 2, 1), (30, 32, 7)):
        got = cuda.fill_full(decode_meta(n, width), key)
        want = cpu.fill_full(decode_meta(n, width), key)
        for name in FIELDS:
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (n, key, name)
        piecewise = cuda.fill_piecewise(decode_meta(n, width), key)
        assert torch.equal(piecewise.slot_mapping.cpu(), cpu.fill_piecewise(decode_meta(n, width), key).slot_mapping)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_upload_is_recorded_on_the_stream_current_at_each_fill():
    """The staging upload's event is recorded on the stream that is current at the fill (the cached
    stream follows a change), and a fill on a side stream is complete once that stream is."""
    buffers = StaticBuffers(max_tokens=8, max_reqs=8, max_blocks_per_seq=4, device=torch.device("cuda"))
    side = torch.cuda.Stream()
    buffers.fill_full(decode_meta(2, 4), 2)
    assert buffers._current_stream() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        view = buffers.fill_full(decode_meta(3, 4), 4)
        assert buffers._current_stream() == side
        torch.cuda._sleep(10_000_000)  # the side stream stays busy: the event must wait for it
        buffers.fill_full(decode_meta(3, 4), 4)
    assert not buffers._copied.query()
    side.synchronize()
    assert buffers._copied.query()
    assert torch.equal(view.seq_lens.cpu(), torch.tensor([6, 7, 8, 0], dtype=torch.int32))
    assert buffers._current_stream() == torch.cuda.current_stream()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_repeated_host_fill_skips_its_staged_pads_and_still_rewrites_every_device_row():
    """A fill of the extent the staging last held writes only its real rows there; the upload still
    carries the padded rows, so device rows spoilt in between are rewritten."""
    cuda = StaticBuffers(max_tokens=64, max_reqs=64, max_blocks_per_seq=16, device=torch.device("cuda"))
    cpu = StaticBuffers(max_tokens=64, max_reqs=64, max_blocks_per_seq=16, device=torch.device("cpu"))
    for step, (n, key, width) in enumerate(((5, 8, 16), (5, 8, 16), (5, 8, 7), (5, 8, 7), (1, 1, 3), (1, 1, 3),
                                            (5, 8, 16))):
        for t in cuda.tensors.values():
            t.fill_(-(2**20) + step)  # device rows spoilt since the last fill
        meta = decode_meta(n, width)
        meta.input_ids += step  # new real rows each step
        got, want = cuda.fill_full(meta, key), cpu.fill_full(meta, key)
        for name in FIELDS:
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (step, name)


class _StagedOnCpu(StaticBuffers):
    """The host-staging path on the CPU: fills go through the staging copy and an upload of its
    prefix, as for a GPU (where the staging is pinned memory and the upload a device copy)."""

    def _targets(self, meta):
        return self._staged, True

    def _upload(self, num_reqs):
        _, offset, (_, width) = self._layout["block_table"]
        end = offset + num_reqs * width * torch.int32.itemsize
        self._pack[:end].copy_(self._staging[:end])


def test_staged_fills_skip_only_padded_rows_still_in_place_and_a_failed_fill_skips_nothing():
    staged = _StagedOnCpu(max_tokens=32, max_reqs=16, max_blocks_per_seq=8, device=torch.device("cpu"))
    direct = StaticBuffers(max_tokens=32, max_reqs=16, max_blocks_per_seq=8, device=torch.device("cpu"))
    sequence = [(8, 8, 8), (3, 8, 2), (3, 8, 2), (3, 8, 5), (1, 1, 3), (1, 1, 3), (8, 8, 8), (3, 8, 2), (3, 8, 2)]
    for step, (n, key, width) in enumerate(sequence):
        if step == 7:  # a fill that raises halfway (a block-table row of another width) ...
            bad = decode_meta(n, width)
            bad.block_table = torch.zeros(n + 1, width, dtype=torch.int32)
            with pytest.raises(ValueError):
                staged.fill_full(bad, key)
        for t in staged.tensors.values():
            t.fill_(-(2**20) + step)  # device rows spoilt since the last fill
        meta = decode_meta(n, width)
        meta.seq_lens += 100 * step
        got, want = staged.fill_full(meta, key), direct.fill_full(meta, key)
        for name in FIELDS:  # ... and the next one still writes the padded rows it left
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
