"""Prompt log-probabilities and ``max_tokens`` 0 through the engine (runtime/engine/prompt_logprobs.py).

On the real SmolLM2 (CPU, float32): the log-probability of every prompt token after the first equals
the log-softmax of the transformers reference's logits over the whole prompt; chunked prefill gives
the numbers of one chunk; a preempted and recomputed prefill scores nothing twice; the sampled-token
path of the other rows is unchanged. On a tiny random model with an emulated graph runner: FULL and
PIECEWISE replays give the prompt log-probabilities of eager execution.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import EngineLimits  # noqa: E402
from graphserving.runtime.engine.block_manager import BlockManager  # noqa: E402
from graphserving.runtime.engine.core import LLMEngine  # noqa: E402
from graphserving.runtime.engine.scheduler import Scheduler  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams, SamplingParamsError, Sequence  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.kv_cache import allocate_kv_cache  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is"
SCORE = SamplingParams(max_tokens=0, prompt_logprobs=3)


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference_logprobs(smollm2_reference, ids):
    """float32 [P, V]: the transformers reference's log-softmax at every prompt position."""
    with torch.inference_mode():
        logits = smollm2_reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def scored(make_engine, ids, params=SCORE, **limits):
    engine = make_engine(**limits)
    choice = engine.generate([ids], params)[0][0]
    return engine, choice


def test_prompt_logprobs_equal_the_reference_log_softmax(make_engine, ids, reference_logprobs):
    _, choice = scored(make_engine, ids)
    entries = choice.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    expected = reference_logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    ours = torch.tensor([e.logprob for e in entries[1:]])
    assert [e.token_id for e in entries[1:]] == ids[1:]
    assert torch.allclose(ours, expected, atol=2e-3), (ours - expected).abs().max()
    for j, e in enumerate(entries[1:]):
        ref_top = reference_logprobs[j].topk(3)
        assert [t for t, _ in e.top] == ref_top.indices.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(ref_top.values.tolist(), abs=2e-3)
        assert e.rank == int((reference_logprobs[j] >= reference_logprobs[j, ids[j + 1]]).sum())


def test_chunked_prefill_gives_the_numbers_of_one_chunk(make_engine, ids):
    _, whole = scored(make_engine, ids)
    engine, chunked = scored(make_engine, ids, max_num_batched_tokens=5, max_num_seqs=4)
    assert len(ids) > 3 * 5  # the prompt spans at least four chunks
    assert [e.token_id for e in chunked.prompt_logprobs[1:]] == ids[1:]
    assert [e.rank for e in chunked.prompt_logprobs[1:]] == [e.rank for e in whole.prompt_logprobs[1:]]
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [t for t, _ in b.top] == [t for t, _ in a.top]


def test_max_tokens_0_finishes_after_the_prefill_with_length_and_frees_the_blocks(make_engine, ids):
    engine, choice = scored(make_engine, ids)
    assert choice.token_ids == [] and choice.text == ""
    assert choice.finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_the_last_prefill_chunk_of_a_max_tokens_0_sequence_samples_nothing():
    scheduler = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=16)
    seq = Sequence(seq_id="a-0", request_id="a", index=0, prompt_token_ids=[5, 6, 7], params=SCORE, seed=0,
                   max_tokens=0)
    scheduler.add(seq)
    (row,) = scheduler.schedule().scheduled
    assert (row.end, row.samples) == (3, False)


def test_max_tokens_0_without_prompt_logprobs_still_finishes(make_engine, ids):
    _, choice = scored(make_engine, ids, SamplingParams(max_tokens=0))
    assert (choice.token_ids, choice.finish_reason, choice.prompt_logprobs) == ([], "length", None)


def test_sampled_tokens_are_unchanged_by_prompt_logprobs_in_the_batch(make_engine, ids, smollm2):
    other = smollm2.tokenizer.encode("Once upon a time, in a land far away,")
    plain = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logprobs=2)
    alone = make_engine().generate([other, ids], [plain, plain])
    mixed = make_engine().generate([other, ids], [plain, dataclasses.replace(plain, prompt_logprobs=1)])
    assert [c[0].token_ids for c in mixed] == [c[0].token_ids for c in alone]
    assert [e.logprob for e in mixed[1][0].logprobs] == pytest.approx([e.logprob for e in alone[1][0].logprobs],
                                                                      abs=1e-5)
    assert mixed[0][0].prompt_logprobs is None and len(mixed[1][0].prompt_logprobs) == len(ids)


def test_choice_0_scores_the_prompt_once_for_all_choices_in_the_first_update(make_engine, ids):
    engine = make_engine()
    outputs = []
    engine.add_request("r", ids, SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=0),
                       on_output=outputs.append)
    engine.step()  # the prefill of all three choices
    assert [len(s.prompt_logprobs) for s in engine.scheduler.running] == [len(ids), 0, 0]
    while engine.has_unfinished():
        engine.step()
    delivered = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(delivered) == 1 and outputs[0].prompt_logprobs is delivered[0]  # in the first update only
    assert len(delivered[0]) == len(ids) and all(e.top == [] for e in delivered[0][1:])


def test_a_preempted_prefill_is_recomputed_without_scoring_twice(make_engine, ids, smollm2):
    first = smollm2.tokenizer.encode("Write a long story about a dragon who lives in a mountain")
    long_run = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine = make_engine(num_kv_blocks=9, block_size=16, max_num_seqs=2)  # 8 usable blocks: 128 tokens
    out = engine.generate([first, ids], [long_run, dataclasses.replace(long_run, prompt_logprobs=2)])
    assert engine.scheduler.num_preemptions > 0
    _, reference = scored(make_engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    entries = out[1][0].prompt_logprobs
    assert len(entries) == len(ids)
    assert [e.logprob for e in entries[1:]] == pytest.approx([e.logprob for e in reference.prompt_logprobs[1:]],
                                                             abs=1e-4)


def test_invalid_values_name_their_field():
    with pytest.raises(SamplingParamsError) as bad_max:
        SamplingParams(max_tokens=-1)
    with pytest.raises(SamplingParamsError) as bad_k:
        SamplingParams(prompt_logprobs=21)
    assert (bad_max.value.param, bad_k.value.param) == ("max_tokens", "prompt_logprobs")


# -- graphs: FULL and PIECEWISE replays carry prompt positions too -------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def tiny_engine(tiny, mode: GraphMode | None) -> LLMEngine:
    """Two rows a step, one token of budget each: a decoding row plus a one-token prefill chunk is a
    uniform-decode batch (a FULL key) whose prefill row scores a prompt token instead of sampling."""
    limits = EngineLimits(max_num_seqs=2, max_num_batched_tokens=2, num_kv_blocks=32, block_size=4,
                          num_scheduler_steps=1)
    kv = allocate_kv_cache(tiny.config, limits.num_kv_blocks, limits.block_size, torch.float32, "cpu")
    runner = None
    if mode is not None:
        runner = GraphRunner(tiny.model, kv, mode=mode, full_sizes=[1, 2], piecewise_sizes=[2, 4],
                             contract=GraphKeyContract(model_revision="test", dtype="float32"), max_blocks_per_seq=31)
        with torch.inference_mode():
            runner.capture_all()
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, device="cpu", dtype=torch.float32,
                     kv_caches=kv, graph_runner=runner)


@pytest.mark.parametrize("mode", [GraphMode.FULL_AND_PIECEWISE, GraphMode.PIECEWISE])
def test_graph_replays_give_the_prompt_logprobs_of_eager_execution(tiny, mode):
    prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)]
    eager = tiny_engine(tiny, None).generate(prompts, params)
    graphed_engine = tiny_engine(tiny, mode)
    graphed = graphed_engine.generate(prompts, params)
    replays = graphed_engine.runner.graph_runner.stats.replays
    assert any(label.startswith("full") if mode.has_full else label.startswith("piecewise") for label in replays)
    for prompt, e, g in zip(prompts, eager, graphed):
        ours, theirs = g[0].prompt_logprobs, e[0].prompt_logprobs
        assert g[0].token_ids == e[0].token_ids
        assert len(ours) == len(prompt) and ours[0] is None
        assert [x.token_id for x in ours[1:]] == [x.token_id for x in theirs[1:]] == prompt[1:]
        assert [x.logprob for x in ours[1:]] == pytest.approx([x.logprob for x in theirs[1:]], abs=1e-5)
        assert [[t for t, _ in x.top] for x in ours[1:]] == [[t for t, _ in x.top] for x in theirs[1:]]
