"""The background step loop: streamed deltas, cancellation, and surviving a failed step (SmolLM2)."""

import asyncio
import threading

import pytest

from graphserving.runtime.engine.async_engine import AsyncLLMEngine, EngineDeadError, burst_settled
from graphserving.runtime.engine.sequence import SamplingParams

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_engine(make_engine):
    engine = AsyncLLMEngine(make_engine())
    engine.start()
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLMEngine, request_id: str, ids: list[int]) -> tuple[str, list[int], list]:
    text, tokens, outs = "", [], []
    async for out in engine.generate(request_id, ids, PARAMS):
        outs.append(out)
        for c in out.choices:
            text += c.text
            tokens += c.token_ids
    return text, tokens, outs


async def test_streamed_deltas_add_up_to_the_synchronous_result(async_engine, make_engine, smollm2):
    ids = smollm2.tokenizer.encode("The sun rises in the")
    expected = make_engine().generate([ids], PARAMS)[0][0]
    text, tokens, outs = await collect(async_engine, "a", ids)
    assert (text, tokens) == (expected.text, expected.token_ids)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].choices[-1].finish_reason == "length"


async def test_concurrent_streams_each_get_their_own_tokens(async_engine, make_engine, smollm2):
    prompts = [smollm2.tokenizer.encode(p) for p in ("Red, green and", "One, two,", "Monday, Tuesday,")]
    expected = [c[0].token_ids for c in make_engine().generate(prompts, PARAMS)]
    results = await asyncio.gather(*(collect(async_engine, f"r{i}", p) for i, p in enumerate(prompts)))
    assert [r[1] for r in results] == expected


async def test_a_consumer_that_stops_early_aborts_its_request(async_engine, smollm2):
    ids = smollm2.tokenizer.encode("Tell me a long story")
    stream = async_engine.generate("long", ids, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    await stream.__anext__()
    await stream.aclose()
    for _ in range(600):  # bounded wait for the loop thread to apply the abort
        if not async_engine.engine.has_unfinished():
            break
        await asyncio.sleep(0.05)
    assert not async_engine.engine.has_unfinished()
    assert async_engine.engine.block_manager.num_used_blocks == 0


async def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_keeps_serving(async_engine, smollm2, monkeypatch):
    runner = async_engine.engine.runner
    real_execute = runner.execute_model
    calls = {"n": 0}

    def failing_once(meta):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device error")
        return real_execute(meta)

    monkeypatch.setattr(runner, "execute_model", failing_once)
    ids = smollm2.tokenizer.encode("Hello there")
    with pytest.raises(EngineDeadError, match="simulated device error"):
        await collect(async_engine, "doomed", ids)
    assert async_engine.is_running
    assert async_engine.engine.block_manager.num_used_blocks == 0
    _, tokens, _ = await collect(async_engine, "fine", ids)
    assert len(tokens) == PARAMS.max_tokens


def test_an_idle_engine_steps_once_a_gap_passes_without_arrivals_or_the_window_ends():
    assert burst_settled(3, 3, now=1.0, deadline=2.0)  # nothing arrived during the last gap
    assert not burst_settled(3, 5, now=1.0, deadline=2.0)  # still arriving, window open
    assert burst_settled(3, 5, now=2.0, deadline=2.0)  # still arriving, window over


async def test_a_burst_reaching_an_idle_engine_is_admitted_in_its_first_step(make_engine, smollm2):
    engine = make_engine()
    queued_at_steps: list[int] = []
    real_step = engine.step

    def recording_step():
        queued_at_steps.append(engine.num_queued)
        return real_step()

    engine.step = recording_step
    # a gap far above the 50 ms between the two arrivals: the second one joins the first step
    async_engine = AsyncLLMEngine(engine, admission_gap_s=0.5, admission_window_s=5.0)
    async_engine.start()
    ids = smollm2.tokenizer.encode("Once upon a time")

    async def late() -> tuple:
        await asyncio.sleep(0.05)
        return await collect(async_engine, "late", ids)

    try:
        first, second = await asyncio.gather(collect(async_engine, "early", ids), late())
    finally:
        async_engine.shutdown()
    assert queued_at_steps[0] == 2
    assert first[1] == second[1] and len(first[1]) == PARAMS.max_tokens


async def test_without_coalescing_a_lone_request_is_served_as_before(make_engine, smollm2):
    async_engine = AsyncLLMEngine(make_engine(), admission_gap_s=0.0)
    async_engine.start()
    ids = smollm2.tokenizer.encode("The sun rises in the")
    try:
        text, tokens, _ = await collect(async_engine, "a", ids)
    finally:
        async_engine.shutdown()
    expected = make_engine().generate([ids], PARAMS)[0][0]
    assert (text, tokens) == (expected.text, expected.token_ids)


async def test_the_updates_of_one_step_reach_the_event_loop_in_one_call(make_engine, smollm2, monkeypatch):
    # no coalescing window and a burst queued before the loop starts: all three rows step together
    engine = AsyncLLMEngine(make_engine(), admission_gap_s=0)
    loop = asyncio.get_running_loop()
    calls = []
    real = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda fn, *args: (calls.append(args), real(fn, *args))[1])
    prompts = [smollm2.tokenizer.encode(p) for p in ("Red, green and", "One, two,", "Monday, Tuesday,")]
    outputs: dict[str, list] = {f"r{i}": [] for i in range(3)}
    done = loop.create_future()

    def on_output(out):
        outputs[out.request_id].append(out)
        if all(o and o[-1].finished for o in outputs.values()) and not done.done():
            done.set_result(None)

    for i, ids in enumerate(prompts):
        engine.submit(f"r{i}", ids, PARAMS, on_output)
    engine.start()
    try:
        await asyncio.wait_for(done, 120)
    finally:
        engine.shutdown()
    tokens = [sum(len(c.token_ids) for out in o for c in out.choices) for o in outputs.values()]
    assert tokens == [PARAMS.max_tokens] * 3
    updates = len(outputs["r0"])  # one per engine step (a multi-step run is one step)
    assert [len(o) for o in outputs.values()] == [updates] * 3
    assert len(calls) == updates  # one hand-over per step, not one per request and step
    assert [len(batch) for (batch,) in calls] == [3] * updates


async def test_shutdown_ends_the_requests_in_flight_with_an_error_instead_of_leaving_them_waiting(make_engine, smollm2):
    engine = AsyncLLMEngine(make_engine())
    engine.start()
    ids = smollm2.tokenizer.encode("Tell me a long story")
    stream = engine.generate("long", ids, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    await stream.__anext__()
    await asyncio.to_thread(engine.shutdown)
    updates = []

    async def drain():
        async for out in stream:
            updates.append(out)

    with pytest.raises(EngineDeadError, match="engine shut down"):
        await asyncio.wait_for(drain(), timeout=30)
    # the last update, handed over before the error is raised, says the choice was aborted
    assert updates[-1].error is not None and updates[-1].choices[-1].finish_reason == "abort"
    assert not engine.engine.has_unfinished() and engine.engine.block_manager.num_used_blocks == 0


async def test_a_request_submitted_after_shutdown_fails_at_once_instead_of_waiting_forever(make_engine, smollm2):
    engine = AsyncLLMEngine(make_engine())
    engine.start()
    engine.shutdown()
    ids = smollm2.tokenizer.encode("Hello there")
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(collect(engine, "late", ids), timeout=30)  # the bound only guards a hang
    assert not engine.engine.has_unfinished() and engine.engine.num_requests == 0


async def _inside_a_blocked_step(engine: AsyncLLMEngine, smollm2, monkeypatch):
    """Start ``engine`` with one request and return once its loop is inside a step that waits for
    the returned event; also returns the request's consumer task."""
    real_step, in_step, release = engine.engine.step, threading.Event(), threading.Event()

    def blocking_step():
        in_step.set()
        release.wait(30)
        return real_step()

    monkeypatch.setattr(engine.engine, "step", blocking_step)
    engine.start()
    consumer = asyncio.ensure_future(collect(engine, "r", smollm2.tokenizer.encode("Hello there")))
    assert await asyncio.to_thread(in_step.wait, 30)
    return release, consumer


async def test_a_call_queued_while_the_loop_stops_fails_instead_of_never_resolving(make_engine, smollm2, monkeypatch):
    engine = AsyncLLMEngine(make_engine())
    release, consumer = await _inside_a_blocked_step(engine, smollm2, monkeypatch)
    call = engine.call_in_loop(lambda: "ran")  # queued during a step: the loop runs calls between steps
    engine._stop.set()  # shutdown requested before the loop comes back for it
    release.set()
    await asyncio.to_thread(engine.shutdown)
    with pytest.raises(EngineDeadError, match="shut down"):
        call.result(timeout=30)
    with pytest.raises(EngineDeadError, match="engine shut down"):  # its prefill ran; the rest never will
        await asyncio.wait_for(consumer, timeout=30)


async def test_a_shutdown_that_times_out_inside_a_step_never_runs_a_call_beside_that_step(make_engine, smollm2, monkeypatch):
    engine = AsyncLLMEngine(make_engine())
    release, consumer = await _inside_a_blocked_step(engine, smollm2, monkeypatch)
    await asyncio.to_thread(engine.shutdown, 0.05)  # returns while the step still runs
    assert engine.is_running
    ran = threading.Event()
    call = engine.call_in_loop(ran.set)  # must not run inline, beside the step in flight
    assert not ran.is_set()
    release.set()
    with pytest.raises(EngineDeadError, match="shut down"):
        call.result(timeout=30)
    assert not ran.is_set()
    with pytest.raises(EngineDeadError, match="engine shut down"):
        await asyncio.wait_for(consumer, timeout=30)
    await asyncio.to_thread(engine.shutdown)
    assert not engine.is_running


async def test_after_the_loop_dies_unexpectedly_a_request_is_refused_instead_of_stranded(make_engine, smollm2, monkeypatch):
    engine = AsyncLLMEngine(make_engine())

    def broken():
        raise RuntimeError("bug in the loop")

    monkeypatch.setattr(engine, "_run_calls", broken)  # outside the step's own error handling
    engine.start()
    await asyncio.to_thread(engine._thread.join, 30)
    assert not engine.is_running and engine.dead_error == "RuntimeError: bug in the loop"
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(collect(engine, "r", smollm2.tokenizer.encode("Hello there")), timeout=30)
