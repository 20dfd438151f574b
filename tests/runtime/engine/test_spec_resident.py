"""Speculative decoding resident on the device (spec_decode/resident.py, step_kernel.py): the batched
n-gram drafter equals the host one; the step kernel (Triton's interpreter here, CUDA on a GPU)
equals the torch reference field for field; the engine runs resident verification runs and
decodes exactly as without speculation."""

from __future__ import annotations

import random

import pytest
import torch

from graphserving.runtime.engine import speculative
from graphserving.runtime.engine.spec_decode.drafter import PAD_DRAFT
from graphserving.runtime.engine.spec_decode.ngram import propose_ngram, propose_ngram_batch
from graphserving.runtime.engine.spec_decode.resident import SpecState, accept, advance, initial_state
from graphserving.runtime.engine.spec_decode.step_kernel import spec_step
from graphserving.runtime.model.forward_metadata import ForwardMetadata
from graphserving.runtime.model.kv_layout import PAD_SLOT_ID

from test_spec_engine import greedy, prompts, run, seeded  # noqa: F401  (prompts: a fixture)

BLOCK_SIZE = 4


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_drafter_proposes_what_the_host_drafter_proposes(seed):
    rng = random.Random(seed)
    for trial in range(40):
        rows, width, k = rng.randint(1, 5), rng.randint(2, 60), rng.randint(1, 8)
        vocab = rng.choice([2, 3, 5, 40])
        history = torch.randint(0, vocab, (rows, width), generator=torch.Generator().manual_seed(seed * 100 + trial))
        lens = torch.tensor([rng.randint(1, width) for _ in range(rows)])
        max_drafts = torch.tensor([rng.randint(-1, 9) for _ in range(rows)])
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 4)
        drafts, num_drafts = propose_ngram_batch(history, lens, max_drafts, k, min_n, max_n)
        for r in range(rows):
            expected = propose_ngram(history[r, :lens[r]].tolist(), max(0, min(k, int(max_drafts[r]))), min_n, max_n)
            assert drafts[r, :num_drafts[r]].tolist() == expected
            assert (drafts[r, num_drafts[r]:] == PAD_DRAFT).all()


def random_run(seed: int, device="cpu", rows: int = 4, k: int = 3, steps: int = 3) -> tuple[SpecState, ForwardMetadata]:
    """A resident run over repetitive random contexts (drafts found) with a scrambled block table."""
    rng = random.Random(seed)
    contexts = []
    for _ in range(rows):
        motif = [rng.randrange(6) for _ in range(rng.randint(2, 5))]
        contexts.append((motif * 20)[:rng.randint(1, 40)])
    remaining = [rng.choice([0, 1, 2, 5, 30]) for _ in range(rows)]
    remaining[0] = 30
    state = initial_state(contexts, remaining, [rng.randrange(10) for _ in range(rows)],
                          [rng.random() < 0.8 for _ in range(rows)], k, steps, torch.device(device))
    q, width = k + 1, 40
    blocks = torch.randperm(rows * width + 1, generator=torch.Generator().manual_seed(seed))[: rows * width] + 1
    meta = ForwardMetadata(
        input_ids=torch.full((rows * q + 2,), 7), positions=torch.full((rows * q + 2,), 7),
        seq_lens=torch.full((rows + 1,), 7, dtype=torch.int32),
        query_lens=torch.full((rows + 1,), q, dtype=torch.int32),
        query_start_loc=torch.arange(rows + 2, dtype=torch.int32) * q,
        block_table=blocks.view(rows, width).to(torch.int32), slot_mapping=torch.full((rows * q + 2,), 7),
        logits_indices=torch.arange(rows * q + 2), num_actual_tokens=rows * q, num_actual_reqs=rows,
        max_query_len=q, uniform_query_len=q,
    ).to(torch.device(device))
    return state, meta


def snapshot(state: SpecState, meta: ForwardMetadata) -> dict[str, torch.Tensor]:
    fields = {name: getattr(state, name) for name in SpecState.__dataclass_fields__}
    # columns past a row's context are scratch (masked writes), so compare each row's context only
    fields["history"] = torch.where(torch.arange(state.history.shape[1])[None, :].to(state.lens.device)
                                    < state.lens[:, None], state.history, -7)
    fields["out_tokens"] = state.out_tokens[:, :-1]  # the last column is the masked writes' sink
    return {**fields, **{f"meta.{n}": t for n, t in meta.tensors().items()}}


def assert_same(a: dict, b: dict) -> None:
    for name in a:
        assert torch.equal(a[name].cpu(), b[name].cpu()), name


def play(state, meta, step_fn, seed: int):
    """Three passes of a run with pseudo-random targets that often accept a prefix of the drafts."""
    gen = torch.Generator().manual_seed(seed)
    step_fn(meta, state, None, 0)
    for step in range(state.proposed.shape[0]):
        k = state.k
        target = torch.randint(0, 6, (state.lens.shape[0], k + 1), generator=gen).to(state.lens.device)
        agree = torch.rand(state.lens.shape[0], k, generator=gen).to(state.lens.device) < 0.7
        target[:, :k] = torch.where(agree, state.drafts.clamp(min=0), target[:, :k])
        step_fn(meta, state, target, step)
    return snapshot(state, meta)


@pytest.mark.parametrize("seed", range(4))
def test_the_step_kernel_matches_the_torch_reference(seed):
    reference = play(*random_run(seed), lambda m, s, t, i: advance(m, s, t, i, BLOCK_SIZE), seed)
    kernel = play(*random_run(seed), lambda m, s, t, i: spec_step(m, s, t, i, BLOCK_SIZE, 1, 3), seed)
    assert_same(kernel, reference)
    assert reference["out_len"].sum() > 0 and reference["accepted"].sum() > 0


def test_a_pass_writes_each_row_as_the_host_verification_metadata_does():
    state, meta = random_run(1)
    advance(meta, state, None, 0, BLOCK_SIZE)
    q = state.k + 1
    for r in range(state.lens.shape[0]):
        rows = slice(r * q, (r + 1) * q)
        n, start, live = int(state.num_drafts[r]), int(state.lens[r]) - 1, bool(state.remaining[r] > 0)
        if not live:
            assert meta.slot_mapping[rows].tolist() == [PAD_SLOT_ID] * q and int(meta.seq_lens[r]) == 0
            continue
        drafts = state.drafts[r, :n].tolist()
        assert meta.input_ids[rows].tolist() == [int(state.history[r, start]), *drafts, *[0] * (q - 1 - n)]
        assert meta.positions[rows].tolist() == [start + min(j, n) for j in range(q)]
        table = meta.block_table[r].tolist()
        assert meta.slot_mapping[rows].tolist() == [
            table[(start + j) // BLOCK_SIZE] * BLOCK_SIZE + (start + j) % BLOCK_SIZE if j <= n else PAD_SLOT_ID
            for j in range(q)]
        assert int(meta.seq_lens[r]) == start + q


def test_a_retired_row_emits_nothing_and_a_row_never_passes_its_remaining_tokens():
    state, meta = random_run(2)
    advance(meta, state, None, 0, BLOCK_SIZE)
    remaining = state.remaining.clone()
    for step in range(state.proposed.shape[0]):
        accept(state, torch.cat([state.drafts.clamp(min=0), state.drafts[:, :1].clamp(min=0)], dim=1), step)
        advance(meta, state, None, step, BLOCK_SIZE)
    assert (state.out_len <= remaining).all()
    assert (state.out_len[remaining == 0] == 0).all()


def test_the_engine_verifies_on_the_device_and_decodes_as_without_speculation(make_engine, prompts, monkeypatch):
    runs = []
    launch = speculative.SpeculativeDecoder.launch_resident

    def counted(self, *args, **kwargs):
        out = launch(self, *args, **kwargs)
        runs.append(out is not None)
        return out

    monkeypatch.setattr(speculative.SpeculativeDecoder, "launch_resident", counted)
    for params in (greedy(32), [seeded(3, 32), seeded(4, 32), seeded(5, 32)]):
        plain = run(make_engine(), prompts, params)
        engine = make_engine(speculative="ngram:4")
        assert run(engine, prompts, params) == plain
        assert engine.spec.stats.accepted_tokens > 0
    assert sum(runs) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(4))
def test_the_step_kernel_on_cuda_matches_the_torch_reference(seed):
    reference = play(*random_run(seed, rows=8, k=4), lambda m, s, t, i: advance(m, s, t, i, BLOCK_SIZE), seed)
    kernel = play(*random_run(seed, "cuda", rows=8, k=4),
                  lambda m, s, t, i: spec_step(m, s, t, i, BLOCK_SIZE, 1, 3), seed)
    assert_same(kernel, reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_a_resident_run_emits_what_host_verification_emits():
    """Resident runs (step kernel, verification keys' static buffers advanced in place, pipelined
    continuations) against one verification at a time from the host, both replaying the same
    FULL keys of query length k + 1: the same tokens, the same acceptance (float32, random
    SmolLM2-shaped weights; repetitive prompts so that drafts are accepted)."""
    from graphserving.contract.graph_policy import GraphMode
    from graphserving.contract.worker_config import EngineLimits
    from graphserving.runtime.engine.core import LLMEngine
    from graphserving.runtime.engine.sequence import SamplingParams
    from graphserving.runtime.graphs.key import GraphKeyContract
    from graphserving.runtime.graphs.runner import GraphRunner
    from graphserving.runtime.model.kv_cache import allocate_kv_cache
    from graphserving.runtime.model.presets import preset_config, preset_tokenizer, random_model

    config = preset_config("smollm2-135m")
    model = random_model(config, torch.float32, "cuda", max_positions=1024, seed=3).eval()
    motif = torch.randint(3, 49152, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    contexts = [motif * 6, (motif[3:] + [17, 4]) * 5, list(range(100, 140))]

    def generate(num_scheduler_steps: int):
        limits = EngineLimits(max_num_seqs=4, num_kv_blocks=96, block_size=16, speculative="ngram:4",
                              num_scheduler_steps=num_scheduler_steps)
        kv = allocate_kv_cache(config, limits.num_kv_blocks, limits.block_size, torch.float32, "cuda")
        runner = GraphRunner(model, kv, mode=GraphMode.FULL, full_sizes=[1, 2, 4], piecewise_sizes=[],
                             contract=GraphKeyContract(model_revision="t", dtype="float32"), max_blocks_per_seq=95,
                             num_speculative_tokens=4)
        with torch.inference_mode():
            assert all(r.ok for r in runner.capture_all())
        engine = LLMEngine(model, config, preset_tokenizer(config.vocab_size), limits, device="cuda",
                           dtype=torch.float32, kv_caches=kv, graph_runner=runner)
        params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True),
                  SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)]
        out = [c[0].token_ids for c in engine.generate(contexts, params)]
        return out, engine.spec.stats, runner.stats.replays

    host, host_stats, _ = generate(1)
    resident, resident_stats, replays = generate(8)
    assert resident == host
    assert resident_stats.accepted_tokens > 0
    assert any(label.endswith("q5") for label in replays)


def test_settling_a_run_judges_its_rows_by_the_windows_of_its_steps():
    """Eight failed steps of a run: two windows, the last one sets the acceptance."""
    from graphserving.runtime.engine.block_manager import BlockManager
    from graphserving.runtime.engine.model_runner import HostSamples
    from graphserving.runtime.engine.scheduler import ScheduledSequence, Scheduler
    from graphserving.runtime.engine.sequence import SamplingParams, Sequence
    from graphserving.runtime.engine.spec_decode.ngram import NgramDrafter
    from graphserving.runtime.engine.spec_decode.policy import DraftHistory
    from graphserving.runtime.engine.speculative import ResidentRun, SpeculativeDecoder

    seq = Sequence(seq_id="s", request_id="r", index=0, prompt_token_ids=list(range(10, 20)),
                   params=SamplingParams(max_tokens=100), seed=0, max_tokens=100)
    seq.draft_history = DraftHistory(acceptance=3.0)
    steps = 8
    counts = torch.tensor([[steps], *[[4]] * steps, *[[0]] * steps])  # out_len; proposed; accepted
    run = ResidentRun([ScheduledSequence(seq, 9, 1, True)], None, None, steps, HostSamples(torch.zeros(steps, 1)),
                      counts, [True])
    decoder = SpeculativeDecoder(NgramDrafter(4), max_model_len=256)
    assert decoder.settle(run, Scheduler(BlockManager(32, block_size=4), 4, 64)) == [steps]
    assert seq.draft_history == DraftHistory(acceptance=0.0, reviewed_at=steps)
    assert decoder.stats.verifications == steps  # the stats count every step run


def test_an_own_block_table_covers_what_undrafted_rows_read():
    from graphserving.runtime.engine.speculative import _read_width

    # q = 5, a row at position 11 with 3 tokens left: a pass can start at 13 and read up to 17
    assert _read_width([(11, 8 * 5, 3)], 5, 16) == 2
    assert _read_width([(11, 1 * 5, 3)], 5, 16) == 1  # one pass reads up to 15
    assert _read_width([(0, 2 * 5, 100), (30, 5, 1)], 5, 16) == 3  # the widest row decides
