"""Multi-step and pipelined decoding under what a server meets: requests arriving and aborts while a
run is pending, tiny KV caches, batches beyond the FULL capture sizes, flushes and dropped graphs.

Each test drives the engine step by step and checks what a client sees (the deltas it is handed)
against the same engine with ``num_scheduler_steps=1``.
"""

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import EngineLimits  # noqa: E402
from graphserving.runtime.engine.core import LLMEngine  # noqa: E402
from graphserving.runtime.engine.output import CompletedChoice  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract, GraphRuntimeMode  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.engine.metrics import EngineMetrics  # noqa: E402
from graphserving.runtime.model.kv_cache import allocate_kv_cache  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3], [1000, 2000], [77] * 5, [123, 456, 789]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def make_engine(tiny, num_scheduler_steps: int, *, num_kv_blocks: int = 64, graphs=None,
                metrics: EngineMetrics | None = None) -> LLMEngine:
    """An engine over the tiny model; ``graphs``: (mode, FULL sizes, PIECEWISE sizes) of an emulated
    graph runner, built over the engine's KV caches and handed to the engine, or None for eager."""
    limits = EngineLimits(max_num_seqs=8, num_kv_blocks=num_kv_blocks, block_size=4,
                          num_scheduler_steps=num_scheduler_steps)
    kv_caches = allocate_kv_cache(tiny.config, num_kv_blocks, limits.block_size, torch.float32, "cpu")
    runner = graph_runner(tiny, kv_caches, limits, *graphs) if graphs is not None else None
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, device="cpu", dtype=torch.float32,
                     metrics=metrics, kv_caches=kv_caches, graph_runner=runner)


def graph_runner(tiny, kv_caches, limits: EngineLimits, mode: GraphMode, full_sizes, piecewise_sizes) -> GraphRunner:
    """A captured graph runner whose static block table is as wide as the engine's context."""
    max_model_len = min(tiny.config.max_model_len, (limits.num_kv_blocks - 1) * limits.block_size)
    runner = GraphRunner(
        tiny.model, kv_caches, mode=mode, full_sizes=full_sizes, piecewise_sizes=piecewise_sizes,
        contract=GraphKeyContract(model_revision="test", dtype="float32"),
        max_blocks_per_seq=-(-max_model_len // limits.block_size),
    )
    with torch.inference_mode():
        runner.capture_all()
    return runner


class Client:
    """Accumulates the deltas each request is handed, as the HTTP server does."""

    def __init__(self):
        self.choices: dict[str, dict[int, CompletedChoice]] = {}
        self.finished: dict[str, int] = {}

    def __call__(self, out) -> None:
        for delta in out.choices:
            self.choices.setdefault(out.request_id, {}).setdefault(delta.index, CompletedChoice(delta.index)).add(delta)
        if out.finished:
            self.finished[out.request_id] = out.num_output_tokens

    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return self.choices[request_id][index].token_ids

    def text(self, request_id: str, index: int = 0) -> str:
        return self.choices[request_id][index].text


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def reference(tiny, prompts, params) -> list[list[int]]:
    return [c[0].token_ids for c in make_engine(tiny, 1).generate(prompts, params)]


# -- every token a run produced reaches the client -----------------------------------------------

def test_a_pending_runs_tokens_reach_the_client_when_a_request_arrives_meanwhile(tiny):
    """The pending run is processed, then the new request's prefill batch (with the running row's
    next decode) runs in the same step: both updates of the running choice must be delivered."""
    engine = make_engine(tiny, 8)
    client = Client()
    engine.add_request("a", PROMPTS[0], GREEDY, on_output=client)
    engine.step()  # prefill
    engine.step()  # 8 decode steps, pending
    engine.add_request("b", PROMPTS[1], GREEDY, on_output=client)
    engine.step()  # a's 8 tokens processed, then a 1-step batch of a's decode and b's prefill
    assert len(client.tokens("a")) == 1 + 8 + 1
    run_to_end(engine)
    assert [client.tokens("a"), client.tokens("b")] == reference(tiny, PROMPTS[:2], GREEDY)
    assert client.text("a") == tiny.tokenizer.decode(client.tokens("a"))
    assert client.finished == {"a": 24, "b": 24}


def test_an_abort_while_a_run_is_pending_delivers_the_runs_tokens_before_the_abort(tiny):
    engine = make_engine(tiny, 8)
    client = Client()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    engine.add_request("a", PROMPTS[0], params, on_output=client)
    engine.step()  # prefill
    engine.step()  # 8 decode steps, pending
    engine.abort("a")
    engine.step()  # the pending run's tokens, then the abort
    choice = client.choices["a"][0]
    assert choice.token_ids == reference(tiny, PROMPTS[:1], GREEDY)[0][:9]
    assert len(choice.logprobs) == 9 and choice.finish_reason == "abort"
    assert client.finished == {"a": 9}
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_a_kv_cache_too_small_for_the_next_run_loses_no_streamed_token(tiny):
    """Six sequences in 19 usable blocks: a run's continuation cannot reserve its slots, the next
    schedule preempts, and the pending run's tokens share a step with a single-step batch."""
    prompts = [[i + 3, i + 50, i + 99] for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=1, ignore_eos=True)
    expected = [c[0].token_ids for c in make_engine(tiny, 1, num_kv_blocks=20).generate(prompts, params)]
    engine = make_engine(tiny, 8, num_kv_blocks=20)
    client = Client()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, on_output=client)
    run_to_end(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [client.tokens(f"r{i}") for i in range(6)] == expected
    assert engine.block_manager.num_used_blocks == 0


# -- graphs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("graphs", [
    (GraphMode.FULL_AND_PIECEWISE, [1, 2], [8, 16]),
    (GraphMode.PIECEWISE, [], [8, 16]),
], ids=["beyond-full-sizes", "piecewise-only"])
@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_a_decode_batch_padded_to_a_piecewise_key_decodes_like_eager(tiny, graphs, num_scheduler_steps):
    """Three decode rows padded to 8 token rows: attention must see the three real rows only."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny, num_scheduler_steps, graphs=graphs)
    ours = [c[0].token_ids for c in engine.generate(PROMPTS[:3], params)]
    assert ours == reference(tiny, PROMPTS[:3], params)
    stats = engine.runner.graph_runner.stats
    assert sum(n for label, n in stats.replays.items() if label.startswith("piecewise")) > 0
    assert engine.block_manager.num_used_blocks == 0


def test_a_pending_run_is_not_continued_on_a_dropped_full_key(tiny):
    """A key dropped (its canary failed) or invalidated must not be replayed again, not even by a
    multi-step run that started on it."""
    engine = make_engine(tiny, 4, graphs=(GraphMode.FULL, [1, 2], []))
    runner = engine.runner.graph_runner
    client = Client()
    engine.add_request("a", PROMPTS[0], GREEDY, on_output=client)
    engine.step()  # prefill (eager: not uniform decode)
    engine.step()  # 4 decode steps replaying full-1, pending
    [key] = [k for k in runner.graphs if k.num_reqs == 1]  # the key of the one-row decode run
    assert key.mode is GraphRuntimeMode.FULL
    replays = runner.stats.replays[key.label()]
    runner.drop(key, "canary failed: test")
    run_to_end(engine)
    assert runner.stats.replays[key.label()] == replays
    assert client.tokens("a") == reference(tiny, PROMPTS[:1], GREEDY)[0]


def test_a_pending_run_is_not_continued_on_a_reconfigured_graph_runner(tiny):
    """A recapture reconfigures the engine's graph runner in place (new static buffers, new graphs):
    a run pending on the old graphs must not replay them again, nor continue on the new ones."""
    engine = make_engine(tiny, 4, graphs=(GraphMode.FULL, [1, 2], []))
    runner = engine.runner.graph_runner
    client = Client()
    engine.add_request("a", PROMPTS[0], GREEDY, on_output=client)
    engine.step()
    engine.step()  # pending on the old graphs' static buffers
    old_replays: list[str] = []

    def counted(label, replay):
        def run():
            old_replays.append(label)
            replay()
        return run

    for key, graph in runner.graphs.items():  # FULL keys: one graph each
        graph.replay = counted(key.label(), graph.replay)
    generation = runner.generation
    runner.reconfigure(GraphMode.FULL, [1, 2], [])
    assert runner.generation > generation and not runner.graphs
    with torch.inference_mode():
        runner.capture_all()
    assert runner.generation > generation
    run_to_end(engine)
    assert old_replays == []
    assert sum(runner.stats.replays.values()) > 0  # the new graphs served the rest
    assert client.tokens("a") == reference(tiny, PROMPTS[:1], GREEDY)[0]


# -- metrics -------------------------------------------------------------------------------------

def test_tokens_of_a_flushed_run_are_counted_as_generated(tiny):
    metrics = EngineMetrics("tiny", 8, 2048)
    engine = make_engine(tiny, 8, metrics=metrics)
    client = Client()
    engine.add_request("a", PROMPTS[0], GREEDY, on_output=client)
    engine.step()
    engine.step()  # pending
    engine.flush()  # what AsyncLLMEngine does before a recapture
    run_to_end(engine)
    generated = metrics.registry.get_sample_value("graphserving_generation_tokens_total", {"model_name": "tiny"})
    assert len(client.tokens("a")) == 24
    assert generated == 24
