"""Host microseconds of the ways to move a small pinned staging pack to the device (static buffers),
and of ``StaticBuffers.fill_full`` of a one-row host batch with its parts (the graph step's fill).

Usage (CUDA): python bench/host_copy_bench.py [--bytes 8192]
"""
import argparse
import ctypes
import statistics
import time

import torch


def host_us(fn, iters=2000, synced=False):
    """Median host microseconds of ``fn``; with ``synced`` the device is idle before every call (so
    a call that waits on earlier device work, as a fill waits on the last upload, does not)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        if synced:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if len(ts) % 64 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def fill_parts() -> None:
    """``StaticBuffers.fill_full`` of a one-row decode batch on the host (context 256, blocks of 16),
    and the upload, event record and ``.numpy()`` view it makes, host us each."""
    from graphserving.runtime.graphs.static_buffers import StaticBuffers
    from graphserving.runtime.model.forward_metadata import ForwardMetadata

    width, context, block_size = 17, 256, 16
    table = torch.arange(1, 1 + width, dtype=torch.int32).view(1, width)
    meta = ForwardMetadata(
        input_ids=torch.tensor([7]), positions=torch.tensor([context]),
        seq_lens=torch.tensor([context + 1], dtype=torch.int32), query_lens=torch.ones(1, dtype=torch.int32),
        query_start_loc=torch.arange(2, dtype=torch.int32), block_table=table,
        slot_mapping=table[:, context // block_size].to(torch.int64) * block_size, logits_indices=torch.arange(1),
        num_actual_tokens=1, num_actual_reqs=1, max_query_len=1)
    buffers = StaticBuffers(256, 256, 512, torch.device("cuda"))
    print(f"fill_full, one host row: {host_us(lambda: buffers.fill_full(meta, 1, 1), synced=True):.1f} us")
    print(f"  its upload (copy_ + event record): {host_us(lambda: buffers._upload(1), synced=True):.1f} us")
    print(f"  one .numpy() view of a batch tensor: {host_us(lambda: meta.seq_lens.numpy()):.1f} us")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=8192)
    n = p.parse_args().bytes
    dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    d, s = dst[:n], pinned[:n]
    ev = torch.cuda.Event()
    print(f"copy_ pinned slice (cached slices): {host_us(lambda: d.copy_(s, non_blocking=True)):.1f} us")
    print(f"copy_ pinned, slicing each time: {host_us(lambda: dst[:n].copy_(pinned[:n], non_blocking=True)):.1f} us")
    print(f"event.record(): {host_us(ev.record):.1f} us")
    print(f"new Event + record: {host_us(lambda: torch.cuda.Event().record()):.1f} us")
    print(f"current_stream().cuda_stream: {host_us(lambda: torch.cuda.current_stream().cuda_stream):.1f} us")
    stream = torch.cuda.current_stream()
    print(f"event.record(stream) of a cached stream: {host_us(lambda: ev.record(stream)):.1f} us")
    index = torch.cuda.current_device()
    print(f"raw current stream handle: {host_us(lambda: torch._C._cuda_getCurrentRawStream(index)):.1f} us")
    registered = torch.zeros(1 << 20, dtype=torch.uint8)
    torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), registered.numel(), 0)
    r = registered[:n]
    print(f"copy_ host-registered slice: {host_us(lambda: d.copy_(r, non_blocking=True)):.1f} us")
    fill_parts()
    lib = None
    for name in ("libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as exc:
            print(f"no {name}: {exc}")
    if lib is None:
        return
    fn = lib.cudaMemcpyAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    dp, sp, raw = d.data_ptr(), s.data_ptr(), torch.cuda.current_stream().cuda_stream
    print(f"ctypes cudaMemcpyAsync: {host_us(lambda: fn(dp, sp, n, 1, raw)):.1f} us")
    t = torch.randint(0, 255, (n,), dtype=torch.uint8)
    s.copy_(t)
    fn(dp, sp, n, 1, raw)
    torch.cuda.synchronize()
    print("ctypes copy correct:", torch.equal(d.cpu(), t))

if __name__ == "__main__":
    main()
