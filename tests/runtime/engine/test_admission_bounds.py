"""The async engine's admission bounds (issue 19, item 7): the defaults from the engine limits, the
queue bound enforced at submit, and every finished, aborted or failed request giving its room back
(SmolLM2 on CPU)."""

import asyncio

import pytest

from graphserving.runtime.engine.async_engine import (
    AsyncLLMEngine,
    EngineOverloadedError,
    admits,
    queued_seqs_bound,
    seqs_per_request_bound,
)
from graphserving.runtime.engine.sequence import SamplingParams

LONG = SamplingParams(n=4, max_tokens=500, temperature=0.0, ignore_eos=True)


def test_one_request_may_fill_a_batch_or_take_openais_128_choices_whichever_is_more():
    assert seqs_per_request_bound(8) == 128
    assert seqs_per_request_bound(64) == 128
    assert seqs_per_request_bound(256) == 256


def test_the_queue_holds_16_batches_and_never_less_than_one_largest_request():
    assert queued_seqs_bound(64, 128) == 1024
    assert queued_seqs_bound(1, 128) == 128


def test_an_idle_engine_admits_any_request_a_busy_one_only_within_the_bound():
    assert admits(0, 500, 100)
    assert admits(96, 4, 100)
    assert not admits(97, 4, 100)


def test_a_queue_bound_below_the_per_request_bound_is_refused(make_engine):
    with pytest.raises(ValueError, match=r"max_queued_seqs \(4\) must be >= max_seqs_per_request \(8\)"):
        AsyncLLMEngine(make_engine(max_num_seqs=8), max_seqs_per_request=8, max_queued_seqs=4)


async def wait_drained(engine: AsyncLLMEngine) -> None:
    for _ in range(400):  # bounded: 20 s
        if engine.num_outstanding_seqs == 0 and not engine.engine.has_unfinished():
            return
        await asyncio.sleep(0.05)


async def test_submit_refuses_past_the_queue_bound_and_an_abort_gives_the_room_back(make_engine, smollm2):
    engine = AsyncLLMEngine(make_engine(max_num_seqs=8), max_seqs_per_request=4, max_queued_seqs=8)
    engine.start()
    try:
        ids = smollm2.tokenizer.encode("Tell me a long story")
        streams = [engine.generate(f"r{i}", ids, LONG) for i in range(2)]
        for s in streams:
            await s.__anext__()
        assert engine.num_outstanding_seqs == 8
        with pytest.raises(EngineOverloadedError, match="8 sequences are running or waiting, at most 8") as err:
            await engine.generate("r2", ids, SamplingParams(max_tokens=1)).__anext__()
        assert (err.value.num_seqs, err.value.outstanding, err.value.bound, err.value.retry_after_s) == (1, 8, 8, 1)
        assert engine.engine.num_requests == 2  # nothing of the refused one was queued
        for s in streams:
            await s.aclose()
        await wait_drained(engine)
        assert engine.num_outstanding_seqs == 0
        assert engine.engine.block_manager.num_used_blocks == 0
        outs = [o async for o in engine.generate("r3", ids, SamplingParams(n=4, max_tokens=2, ignore_eos=True))]
        assert outs[-1].finished
        assert engine.num_outstanding_seqs == 0
    finally:
        engine.shutdown()


async def test_requests_failed_at_shutdown_give_their_room_back(make_engine, smollm2):
    engine = AsyncLLMEngine(make_engine(max_num_seqs=4))
    engine.start()
    ids = smollm2.tokenizer.encode("Tell me a long story")
    stream = engine.generate("r", ids, LONG)
    await stream.__anext__()
    assert engine.num_outstanding_seqs == 4
    await asyncio.to_thread(engine.shutdown)
    with pytest.raises(Exception, match="engine shut down"):
        async for _ in stream:
            pass
    assert engine.num_outstanding_seqs == 0
