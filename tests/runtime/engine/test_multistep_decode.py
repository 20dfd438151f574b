"""Multi-step decoding: several decode steps per schedule, sampled tokens fed back on the device.

Every test compares against the same engine with ``num_scheduler_steps=1`` (one host round trip
per token), which the rest of the suite checks against transformers: multi-step must change
nothing a client can see except how tokens are grouped into updates.
"""

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import EngineLimits  # noqa: E402
from graphserving.runtime.engine.block_manager import BlockManager  # noqa: E402
from graphserving.runtime.engine.core import LLMEngine  # noqa: E402
from graphserving.runtime.engine.scheduler import decode_steps  # noqa: E402
from graphserving.runtime.model.forward_metadata import ForwardMetadata  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from graphserving.runtime.graphs.key import GraphKeyContract  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.kv_cache import allocate_kv_cache  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.engine.decode_advance import advance_decode  # noqa: E402
from graphserving.runtime.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams, Sequence  # noqa: E402


def make_seq(name: str, prompt_len: int = 3, max_tokens: int = 8, **params) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0), **params)
    return Sequence(seq_id=name, request_id=name, index=0, prompt_token_ids=list(range(1, prompt_len + 1)),
                    params=p, seed=0, max_tokens=max_tokens)


def decode_row(seq: Sequence) -> ScheduledSequence:
    seq.num_computed_tokens = seq.num_tokens - 1
    return ScheduledSequence.of(seq, 1)


# -- the policy (pure) ---------------------------------------------------------------------------

def test_decode_steps_is_bounded_by_the_setting_and_by_every_rows_remaining_tokens():
    rows = [decode_row(make_seq("a", max_tokens=20)), decode_row(make_seq("b", max_tokens=5))]
    assert decode_steps(rows, 8, admission_pending=False) == 5
    assert decode_steps(rows[:1], 8, admission_pending=False) == 8
    assert decode_steps(rows, 1, admission_pending=False) == 1


def test_decode_steps_is_one_for_prefill_penalties_or_a_pending_admission():
    decoding = decode_row(make_seq("a", max_tokens=20))
    prefill = ScheduledSequence.of(make_seq("p", prompt_len=6), 6)
    penalised = decode_row(make_seq("r", max_tokens=20, repetition_penalty=1.2))
    assert decode_steps([decoding, prefill], 8, admission_pending=False) == 1
    assert decode_steps([decoding, penalised], 8, admission_pending=False) == 1
    assert decode_steps([decoding], 8, admission_pending=True) == 1
    assert decode_steps([], 8, admission_pending=False) == 1


def test_reserve_decode_steps_gives_every_row_its_slots_or_none():
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 usable blocks
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq("a", prompt_len=3), make_seq("b", prompt_len=3)
    for s in (a, b):
        sched.add(s)
    sched.commit(sched.schedule())  # prefill: one block each
    for s in (a, b):
        s.output_token_ids.append(7)
    out = sched.schedule()
    assert [r.start for r in out.scheduled] == [3, 3]
    # 6 steps need positions 3..8: 3 blocks each, 4 more in all, only 1 free -> nothing allocated
    assert not sched.reserve_decode_steps(out, 6)
    assert [len(bm.block_table(s)) for s in ("a", "b")] == [1, 1] and bm.num_free_blocks == 1
    # 2 steps need positions 3..4: a second block for each... still 2 > 1 free
    assert not sched.reserve_decode_steps(out, 2)
    sched.finish(b, reason=__import__("graphserving.runtime.engine.sequence", fromlist=["FinishReason"]).FinishReason.ABORT)
    out = SchedulerOutput(scheduled=[r for r in out.scheduled if r.seq is a])
    assert sched.reserve_decode_steps(out, 6)
    assert len(bm.block_table("a")) == 3
    sched.commit(out, num_steps=6)
    assert a.num_computed_tokens == 9


def test_advance_decode_builds_the_next_steps_metadata_and_keeps_padded_rows():
    block_size = 4
    table = torch.tensor([[5, 9, 0], [2, 3, 0], [0, 0, 0]], dtype=torch.int32)
    meta = ForwardMetadata(
        input_ids=torch.tensor([11, 12, 0]), positions=torch.tensor([3, 6, 0]),
        seq_lens=torch.tensor([4, 7, 0], dtype=torch.int32), query_lens=torch.ones(3, dtype=torch.int32),
        query_start_loc=torch.arange(4, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor([5 * 4 + 3, 3 * 4 + 2, PAD_SLOT_ID]), logits_indices=torch.arange(3),
        num_actual_tokens=3, num_actual_reqs=3, max_query_len=1,
    )
    advance_decode(meta, torch.tensor([21, 22]), num_reqs=2, block_size=block_size)
    assert meta.input_ids.tolist() == [21, 22, 0]
    assert meta.positions.tolist() == [4, 7, 0]
    assert meta.seq_lens.tolist() == [5, 8, 0]
    # position 4 of row 0 -> block_table[0][1] = 9, offset 0; position 7 of row 1 -> block 3, offset 3
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 3 * 4 + 3, PAD_SLOT_ID]


# -- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3], [1000, 2000], [77] * 5, [123, 456, 789]]


def params_mix(stop_text: str | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=40, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=1.0, min_p=0.05, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, stop=(stop_text,) if stop_text else ()),
        SamplingParams(max_tokens=15, temperature=0.7, seed=5, ignore_eos=True, n=2),
    ]


def engine_for(tiny, num_scheduler_steps: int, graphs: bool = False, device: str = "cpu") -> LLMEngine:
    limits = EngineLimits(max_num_seqs=8, num_kv_blocks=64, block_size=4, num_scheduler_steps=num_scheduler_steps)
    kv_caches = allocate_kv_cache(tiny.config, limits.num_kv_blocks, limits.block_size, torch.float32, device)
    runner = None
    if graphs:  # emulated CUDA graphs on the CPU: the same static buffers and replay contract
        max_model_len = min(tiny.config.max_model_len, (limits.num_kv_blocks - 1) * limits.block_size)
        runner = GraphRunner(
            tiny.model, kv_caches, mode=GraphMode.FULL_AND_PIECEWISE, full_sizes=[1, 2, 4, 8],
            piecewise_sizes=[8, 16, 32, 64], contract=GraphKeyContract(model_revision="test", dtype="float32"),
            max_blocks_per_seq=-(-max_model_len // limits.block_size),
        )
        with torch.inference_mode():
            runner.capture_all()
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, device=device, dtype=torch.float32,
                     kv_caches=kv_caches, graph_runner=runner)


def spy_steps(engine: LLMEngine) -> list[int]:
    """Record the steps of every launch: ``n`` for ``runner.run``, ``-n`` for a pipelined continuation."""
    calls: list[int] = []
    inside_run = []
    run, cont = engine.runner.run, engine.runner.continue_decode

    def wrapped(out, num_steps=1):
        calls.append(num_steps)
        inside_run.append(True)
        try:
            return run(out, num_steps)
        finally:
            inside_run.pop()

    def continued(decode, num_steps, retire=None):
        if not inside_run:  # the engine's own continuation, not run()'s steps after the first
            calls.append(-num_steps)
        return cont(decode, num_steps, retire)

    engine.runner.run = wrapped
    engine.runner.continue_decode = continued
    return calls


def summary(choices):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [round(lp.logprob, 4) for lp in c.logprobs]) for c in req] for req in choices]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_multi_step_generation_equals_single_step_generation(tiny, graphs):
    single = engine_for(tiny, 1, graphs)
    reference = single.generate(PROMPTS, params_mix())
    text = reference[3][0].text
    stop = text[len(text) // 2: len(text) // 2 + 2] if len(text) > 4 else None
    reference = single.generate(PROMPTS, params_mix(stop))
    multi = engine_for(tiny, 8, graphs)
    steps = spy_steps(multi)
    ours = multi.generate(PROMPTS, params_mix(stop))
    assert summary(ours) == summary(reference)
    assert max(steps) == 8  # multi-step decoding ran
    assert min(steps) < 0  # and was continued before its tokens were processed (pipelined)
    assert multi.block_manager.num_used_blocks == 0
    if graphs:
        stats = multi.runner.graph_runner.stats
        assert sum(v for k, v in stats.replays.items() if k.startswith("full")) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_multi_step_through_cuda_graphs_equals_single_step(tiny_model_dir):
    """On CUDA a continuation advances the static buffers with the advance kernel and samples the
    graph's logits buffer uncopied: the same tokens, texts and log-probabilities as single steps."""
    cuda = load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cuda")
    reference = engine_for(cuda, 1, graphs=True, device="cuda").generate(PROMPTS, params_mix())
    multi = engine_for(cuda, 8, graphs=True, device="cuda")
    steps = spy_steps(multi)
    ours = multi.generate(PROMPTS, params_mix())
    assert summary(ours) == summary(reference)
    assert max(steps) == 8 and min(steps) < 0
    stats = multi.runner.graph_runner.stats
    assert sum(v for k, v in stats.replays.items() if k.startswith("full")) > 0


def test_multi_step_through_graphs_after_a_larger_batch_leaks_nothing(tiny):
    """A 3-row batch advancing inside the buffers of a 4-row key after 8-row batches filled them."""
    multi = engine_for(tiny, 8, graphs=True)
    many = [[i + 10, i + 20, i + 30] for i in range(8)]
    multi.generate(many, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    multi.runner.graph_runner.buffers.poison(torch.Generator().manual_seed(3))
    few = PROMPTS[:3]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [c[0].token_ids for c in multi.generate(few, params)]
    reference = [c[0].token_ids for c in engine_for(tiny, 1).generate(few, params)]
    assert ours == reference


def test_a_request_arriving_during_decoding_is_admitted_at_the_next_schedule(tiny):
    engine = engine_for(tiny, 8)
    steps = spy_steps(engine)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # 8 decode steps
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    assert steps == [1, 8, 1]  # b's prefill (with a's decode) ran one step, not after 8 more of a's
    assert engine.scheduler.num_running == 2


def test_pipelined_continuation_discards_tokens_after_a_stop_and_frees_every_block(tiny):
    """A row that hits its stop token in run n still runs (and is discarded) in continuation n+1."""
    free = engine_for(tiny, 1).generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    tokens = free[0][0].token_ids
    stop_id = tokens[3]  # the 4th generated token
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,)),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    reference = engine_for(tiny, 1).generate(PROMPTS[:2], params)
    engine = engine_for(tiny, 4)
    steps = spy_steps(engine)
    ours = engine.generate(PROMPTS[:2], params)
    assert summary(ours) == summary(reference)
    assert ours[0][0].token_ids == tokens[: tokens.index(stop_id) + 1]
    assert ours[0][0].finish_reason == "stop"
    # prefill, 4 steps, then a continuation of both rows launched before the stop was seen
    assert steps[:3] == [1, 4, -4]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_a_row_that_reaches_max_tokens_is_retired_into_padding_while_the_others_continue(tiny, graphs):
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)]
    reference = engine_for(tiny, 1, graphs).generate(PROMPTS[:3], params)
    engine = engine_for(tiny, 8, graphs)
    steps = spy_steps(engine)
    retired = []
    cont = engine.runner.continue_decode

    def spy(decode, num_steps, retire=None):
        retired.append(list(retire or []))
        return cont(decode, num_steps, retire)

    engine.runner.continue_decode = spy
    ours = engine.generate(PROMPTS[:3], params)
    assert summary(ours) == summary(reference)
    # prefill; 4 steps (row 0 has 4 tokens left); row 0 retired, 8 steps; 1 step (row 2's last);
    # row 2 retired, 6 steps for row 1
    assert steps == [1, 4, -8, -1, -6]
    assert retired == [[], [0], [], [2]]  # the first: run()'s own steps after its first
    assert engine.block_manager.num_used_blocks == 0


def test_a_final_only_request_gets_one_update_per_choice_with_everything(tiny):
    engine = engine_for(tiny, 4)
    params = SamplingParams(max_tokens=11, temperature=0.8, seed=9, ignore_eos=True, n=2)
    streamed, final = [], []
    engine.add_request("s", PROMPTS[1], params, on_output=streamed.append)
    engine.add_request("f", PROMPTS[1], params, on_output=final.append, final_only=True)
    while engine.has_unfinished():
        engine.step()
    assert len(streamed) > 2
    assert [len(out.choices) for out in final] == [2] and final[0].finished  # both choices end together
    for delta in final[0].choices:
        whole = [c for out in streamed for c in out.choices if c.index == delta.index]
        assert delta.token_ids == [t for c in whole for t in c.token_ids]
        assert delta.text == "".join(c.text for c in whole) and delta.finish_reason == "length"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_blocks_reserved_for_a_continuation_reach_the_device_block_table(tiny, graphs):
    """Every continuation starts from a device block table equal to the host's, row for row."""
    engine = engine_for(tiny, 8, graphs)
    bm = engine.block_manager
    cont = engine.runner.continue_decode
    checked = []

    def spy(decode, num_steps, retire=None):
        outputs = cont(decode, num_steps, retire)
        for i, seq_id in enumerate(decode.seq_ids):
            if i in decode.retired:
                assert set(decode.meta.block_table[i].tolist()) == {NULL_BLOCK}
                continue
            table = bm.block_table(seq_id)
            assert decode.meta.block_table[i, : len(table)].tolist() == table
            assert set(decode.meta.block_table[i, len(table):].tolist()) <= {NULL_BLOCK}
            checked.append(len(table))
        return outputs

    engine.runner.continue_decode = spy
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 9, 30)]
    engine.generate(PROMPTS[:3], params)
    assert max(checked) > 3  # rows grew well past the blocks of their first run (block size 4)


# -- host staging of a run's tokens ----------------------------------------------------------------

def test_staged_tokens_come_back_as_lists_in_step_order():
    from graphserving.runtime.engine.model_runner import stage_to_host
    from graphserving.runtime.engine.sampler import SamplerOutput

    assert stage_to_host([]) is None
    staged = stage_to_host([SamplerOutput(torch.tensor([3, 4])), SamplerOutput(torch.tensor([5, 6]))])
    assert staged.ready is None
    assert staged.lists() == ([[3, 4], [5, 6]], None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staged_tokens_are_read_without_waiting_for_work_queued_after_them():
    """The pipelining contract: run k's tokens are readable while run k+1 still runs."""
    from graphserving.runtime.engine.model_runner import stage_to_host, to_device
    from graphserving.runtime.engine.sampler import SamplerOutput

    tokens = to_device([7, 8, 9], torch.int64, torch.device("cuda")) + 1
    staged = stage_to_host([SamplerOutput(tokens)])
    torch.cuda._sleep(2_000_000_000)  # about a second of device time queued behind the copy
    assert staged.lists()[0] == [[8, 9, 10]]
    assert not torch.cuda.current_stream().query()  # the later work is still running
    torch.cuda.synchronize()
