"""The engine's router-facing metrics: KV-cache usage as a ratio, queue time, inter-token latency
(ITL) and the router protocol's aliases, on the real SmolLM2 engine on CPU; and the weighted
histogram behind ITL against prometheus_client's own Histogram."""

import pytest
from prometheus_client import CollectorRegistry, Histogram

from graphserving.runtime.engine.metrics import ROUTER_ALIASES, HistogramCollector, WeightedHistogram
from graphserving.runtime.engine.sequence import SamplingParams

LABELS = {"model_name": "smollm2"}
PROMPTS = ["My favourite animal is", "In the beginning of the story, the hero", "Paris is"]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def value(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name, LABELS)


def run_to_end(engine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def samples(registry) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in registry.collect() for s in f.samples
            if not s.name.endswith("_created")]


# -- the weighted accumulator ----------------------------------------------------------------------

def test_weighted_observations_land_in_the_bucket_whose_bound_they_do_not_exceed():
    hist = WeightedHistogram([0.1, 0.5, 1.0])
    hist.add([0.1, 0.0, 0.3, 0.5, 2.0], [2, 1, 1, 3, 4])  # on a bound: that bound's bucket
    assert hist.snapshot() == ([3.0, 7.0, 7.0, 11.0], pytest.approx(0.2 + 0.3 + 1.5 + 8.0))
    hist.add([1.0 + 1e-9], [1])  # just above the last bound: +Inf
    counts, total = hist.snapshot()
    assert counts == [3.0, 7.0, 7.0, 12.0]
    assert total == pytest.approx(11.0 + 1e-9)


def test_bounds_must_be_finite_and_ascending():
    for bad in ([], [0.5, 0.1], [0.1, 0.1], [0.1, float("inf")]):
        with pytest.raises(ValueError, match="strictly ascending"):
            WeightedHistogram(bad)


def test_the_collector_exposes_what_a_histogram_observed_one_by_one_exposes():
    bounds, values, weights = [0.005, 0.01, 0.025], [0.004, 0.01, 0.02, 0.3], [3, 1, 2, 2]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = WeightedHistogram(bounds)
    ours.register(HistogramCollector("itl_seconds", "ITL.", LABELS, hist))
    reference = Histogram("itl_seconds", "ITL.", list(LABELS), buckets=bounds, registry=theirs).labels(**LABELS)
    assert samples(ours) == samples(theirs)  # at zero from registration on
    hist.add(values, weights)
    for v, w in zip(values, weights):
        for _ in range(w):
            reference.observe(v)
    got, want = samples(ours), samples(theirs)
    assert [g[:2] for g in got] == [w[:2] for w in want]  # _bucket (le up to +Inf), _count, _sum
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want])
    assert [g[1]["le"] for g in got if g[0] == "itl_seconds_bucket"] == ["0.005", "0.01", "0.025", "+Inf"]


# -- through the engine ----------------------------------------------------------------------------

def test_kv_cache_usage_ratio_is_used_over_usable_blocks_and_the_aliases_repeat_our_gauges(make_engine, prompts):
    engine = make_engine(metrics=True, max_num_seqs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    bm = engine.block_manager
    assert bm.num_used_blocks > 0
    assert value(engine, "graphserving_kv_cache_usage_ratio") == bm.num_used_blocks / bm.num_total_blocks
    assert value(engine, "graphserving_kv_cache_used_blocks") == bm.num_used_blocks
    assert value(engine, "graphserving_kv_cache_capacity_blocks") == bm.num_total_blocks
    assert (value(engine, "graphserving_requests_running"), value(engine, "graphserving_requests_waiting")) == (1, 2)
    for alias, ours in ROUTER_ALIASES.items():
        assert value(engine, alias) == value(engine, ours), alias
    run_to_end(engine)
    assert value(engine, "graphserving_kv_cache_usage_ratio") == 0.0
    assert value(engine, "vllm:kv_cache_usage_perc") == 0.0
    assert value(engine, "vllm:num_requests_waiting") == 0.0


def test_usage_ratio_is_zero_without_usable_blocks(make_engine):
    engine = make_engine(metrics=True)
    engine.metrics.observe_queues(running=0, waiting=0, kv_used=0, kv_total=0)
    assert value(engine, "graphserving_kv_cache_usage_ratio") == 0.0
    assert value(engine, "vllm:kv_cache_usage_perc") == 0.0


def test_a_request_made_to_wait_has_a_queue_time_of_at_least_the_other_requests_run_time(make_engine, prompts):
    engine = make_engine(metrics=True, max_num_seqs=1)
    finished = []
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("a", prompts[0], params, on_output=lambda out: out.finished and finished.append(out.request_id))
    engine.add_request("b", prompts[1], params)
    engine.step()
    assert value(engine, "graphserving_request_queue_time_seconds_count") == 1  # a runs, b waits
    queue_a = value(engine, "graphserving_request_queue_time_seconds_sum")
    while not finished:
        engine.step()
    assert value(engine, "graphserving_e2e_request_latency_seconds_count") == 1
    run_a = value(engine, "graphserving_e2e_request_latency_seconds_sum") - queue_a
    run_to_end(engine)
    assert value(engine, "graphserving_request_queue_time_seconds_count") == 2
    queue_b = value(engine, "graphserving_request_queue_time_seconds_sum") - queue_a
    assert run_a > 0
    assert queue_b >= run_a


def test_every_choice_is_queued_once_even_when_preempted(make_engine, prompts):
    # 7 usable blocks of 4 tokens for 3 sequences that grow to 3 blocks each: some are preempted
    engine = make_engine(metrics=True, num_kv_blocks=8, block_size=4)
    engine.add_request("a", prompts[2], SamplingParams(n=2, max_tokens=10, temperature=0, ignore_eos=True))
    engine.add_request("b", prompts[2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    run_to_end(engine)
    assert value(engine, "graphserving_preemptions_total") > 0
    assert value(engine, "graphserving_request_queue_time_seconds_count") == 3


def test_itl_counts_every_output_token_after_the_first_under_multi_step_decoding(make_engine, prompts, smollm2):
    engine = make_engine(metrics=True, num_scheduler_steps=8)
    bos = prompts[0][:1]  # a one-token prompt: its first run may already be multi-step
    requests = [(prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
                (prompts[1], SamplingParams(n=2, max_tokens=13, temperature=0.8, seed=3, ignore_eos=True)),
                (prompts[2], SamplingParams(max_tokens=30, temperature=0, stop=(".", ","))),
                (bos, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))]
    tokens = {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params,
                           on_output=lambda out: [tokens.setdefault((out.request_id, c.index), []).extend(c.token_ids)
                                                  for c in out.choices])
    seqs = [seq for req in engine._requests.values() for seq in req.seqs]
    steps = run_to_end(engine)
    counts = [len(t) for t in tokens.values()]
    assert len(counts) == 5 and min(counts) >= 1
    assert steps < sum(counts) / 2  # multi-step runs did the decoding
    assert value(engine, "graphserving_inter_token_latency_seconds_count") == sum(c - 1 for c in counts)
    inf = engine.metrics.registry.get_sample_value("graphserving_inter_token_latency_seconds_bucket",
                                                   {**LABELS, "le": "+Inf"})
    assert inf == sum(c - 1 for c in counts)
    # a sequence's intervals add up to its last token's time minus its first's (its first run spread
    # over the time since its admission)
    spans = sum(s.last_token_time - s.first_token_time for s in seqs)
    assert value(engine, "graphserving_inter_token_latency_seconds_sum") >= spans - 1e-9
    first_runs = sum(s.first_token_time - s.first_scheduled_time for s in seqs)
    assert value(engine, "graphserving_inter_token_latency_seconds_sum") <= spans + first_runs + 1e-9


def test_the_first_run_of_a_one_token_prompt_can_be_multi_step_and_counts_its_tokens_after_the_first(make_engine):
    engine = make_engine(metrics=True, num_scheduler_steps=8)
    deltas = []
    engine.add_request("a", [1], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
                       on_output=lambda out: deltas.extend(len(c.token_ids) for c in out.choices))
    (seq,) = engine._requests["a"].seqs
    run_to_end(engine)
    assert deltas == [8, 1]  # prefill and 7 decode steps in one run, then the last token
    assert value(engine, "graphserving_inter_token_latency_seconds_count") == 8
    first_run = (seq.first_token_time - seq.first_scheduled_time) * 7 / 8
    assert value(engine, "graphserving_inter_token_latency_seconds_sum") == pytest.approx(
        first_run + seq.last_token_time - seq.first_token_time)
