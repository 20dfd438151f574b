"""Streamed updates of multi-step runs (the stream interval) and server-side aborts, on the real
SmolLM2 engine."""

from graphserving.runtime.engine.output import stream_cuts
from graphserving.runtime.engine.sequence import SamplingParams

LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(engine) -> dict[str, list]:
    """Step until idle; every delta of every request, in order."""
    deltas: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).extend(out.choices)
    return deltas


def test_stream_cuts_after_the_first_token_and_every_interval():
    assert stream_cuts(0, 8, 1) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert stream_cuts(0, 8, 3) == [1, 3, 6]
    assert stream_cuts(8, 8, 3) == [1, 4, 7]  # the run's tokens 9, 12 and 15
    assert stream_cuts(3, 2, 8) == []


def test_interval_one_turns_a_multi_step_run_into_one_delta_per_token(make_engine, smollm2):
    engine = make_engine(num_scheduler_steps=8)
    engine.add_request("a", smollm2.tokenizer.encode("Once upon a time"), LONG, stream_interval=1)
    deltas = run(engine)["a"]
    assert [len(d.token_ids) for d in deltas] == [1] * 24
    assert deltas[-1].finish_reason == "length"


def test_interval_three_cuts_after_the_first_token_then_every_third(make_engine, smollm2):
    engine = make_engine(num_scheduler_steps=8)
    ids = smollm2.tokenizer.encode("Once upon a time")
    engine.add_request("a", ids, LONG, stream_interval=3)
    deltas = run(engine)["a"]
    assert [len(d.token_ids) for d in deltas] == [1, 2, 3, 3, 3, 3, 3, 3, 3]
    [[whole]] = make_engine(num_scheduler_steps=8).generate([ids], LONG)
    assert "".join(d.text for d in deltas) == whole.text


def test_without_an_interval_a_multi_step_run_is_one_delta(make_engine, smollm2):
    engine = make_engine(num_scheduler_steps=8)
    engine.add_request("a", smollm2.tokenizer.encode("Once upon a time"), LONG)
    assert max(len(d.token_ids) for d in run(engine)["a"]) == 8


def test_abort_all_finishes_every_request_submitted_before_it_with_abort(make_engine, smollm2, caplog):
    caplog.set_level("INFO", logger="graphserving.runtime.engine.core")
    engine = make_engine(num_scheduler_steps=8)
    ids = smollm2.tokenizer.encode("Once upon a time")
    engine.add_request("a", ids, SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0))
    engine.step()
    engine.add_request("b", ids, SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0))
    engine.abort_all("drain deadline")
    engine.add_request("c", ids, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    deltas = run(engine)
    assert [deltas[r][-1].finish_reason for r in "abc"] == ["abort", "abort", "length"]
    assert sum(1 for m in caplog.messages if "aborted (drain deadline)" in m) == 2
    assert engine.block_manager.num_used_blocks == 0
