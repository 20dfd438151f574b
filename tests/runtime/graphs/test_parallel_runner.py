"""Graph runners of a tensor-parallel group (runtime/graphs/parallel.py): rank 0 decides, the others follow.

Two processes each hold half of a tiny random model (gloo and emulated CUDA graphs on the CPU; NCCL
and CUDA graphs on two GPUs): rank 0 runs the engine through a :class:`LeaderRunner`, rank 1
:func:`follow`. The engine's greedy tokens equal the
single-process engine's, and both ranks replay the same keys the same number of times (the follower
checks each of rank 0's dispatch decisions against its own). In one process, over a recorded
channel, the follower refuses a decision its own captured keys would not make.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import CanaryThresholds, EngineLimits
from graphserving.dev.ports import free_port
from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.sequence import SamplingParams
from graphserving.runtime.graphs import online_canary
from graphserving.runtime.graphs.canary import run_canary
from graphserving.runtime.graphs.key import GraphKeyContract
from graphserving.runtime.graphs.online_canary import OnlineCanary
from graphserving.runtime.graphs.parallel import (CommandChannel, LeaderRunner, RankDivergenceError, exit_group,
                                                  follow)
from graphserving.runtime.graphs.runner import GraphRunner
from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.loader import load_model
from graphserving.runtime.model.parallel import ParallelLayout, TensorParallel

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])]
LIMITS = EngineLimits(max_num_seqs=8, num_kv_blocks=64, block_size=4, num_scheduler_steps=1)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3], [1000, 2000], [77] * 5, [123, 456, 789]]
"""A replayed trace: five requests at once (prefill then mixed decode batches of 5, 4, ... rows)."""
MAX_TOKENS = [13, 9, 17, 11, 15]


def _kv(loaded) -> list[torch.Tensor]:
    return allocate_kv_cache(loaded.config, LIMITS.num_kv_blocks, LIMITS.block_size, torch.float32, loaded.device)


def _runner(loaded, kv_caches) -> GraphRunner:
    max_model_len = min(loaded.config.max_model_len, (LIMITS.num_kv_blocks - 1) * LIMITS.block_size)
    return GraphRunner(
        loaded.model, kv_caches, mode=GraphMode.FULL_AND_PIECEWISE, full_sizes=[1, 2, 4],
        piecewise_sizes=[8, 16, 32, 64],
        contract=GraphKeyContract(model_revision="test", dtype="float32", parallel_layout=loaded.model.parallel_layout),
        max_blocks_per_seq=-(-max_model_len // LIMITS.block_size),
    )


def _generate(loaded, executor, kv_caches) -> list[list[int]]:
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, LIMITS, device=loaded.device, dtype=torch.float32,
                       kv_caches=kv_caches, graph_runner=executor)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    return [req[0].token_ids for req in engine.generate(PROMPTS, params)]


def _stats(runner: GraphRunner) -> dict:
    return {"replays": dict(runner.stats.replays),
            "eager": {r.value: n for r, n in runner.stats.eager.items() if n}}


def _rank(rank: int, world: int, port: int, path: str, out: str, device: str) -> None:
    cuda = device == "cuda"
    where = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(where)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **({"device_id": where} if cuda else {}))
    try:
        loaded = load_model(path, revision=None, dtype=torch.float32, device=where,
                            parallel=TensorParallel(ParallelLayout(world, rank)))
        kv = _kv(loaded)
        runner, channel = _runner(loaded, kv), CommandChannel(dist.new_group(backend="gloo"))
        result: dict = {}
        if rank == 0:
            leader = LeaderRunner(runner, channel)
            with torch.inference_mode():
                captured = [c.key for c in leader.capture_all() if c.ok]
            result["tokens"] = _generate(loaded, leader, kv)
            leader.drop(captured[-1], "dropped on rank 0: every rank stops replaying it")
            result["after_drop"] = _generate(loaded, leader, kv)
            leader.online_canary = OnlineCanary(CanaryThresholds(sample_rate=1.0), torch.float32)
            result["compared"] = _generate(loaded, leader, kv)  # every replay's eager pass on both ranks
            result["comparisons"] = leader.online_canary.comparisons
            leader.online_canary = None
            leader.stop_followers()
        else:
            result["commands"] = follow(runner, channel)
        result["stats"] = _stats(runner)
        result["captured"] = [k.label() for k in runner.captured_keys()]
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        if not cuda:  # with NCCL the process's exit releases the group (runtime/lifecycle/ranks.py)
            dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_serve_the_single_process_tokens_replaying_the_same_keys(device, tiny_model_dir, tmp_path):
    path = str(tiny_model_dir("llama3_rope"))
    single = load_model(path, revision=None, dtype=torch.float32, device=device)
    kv = _kv(single)
    reference = _runner(single, kv)
    with torch.inference_mode():
        reference.capture_all()
    expected = _generate(single, reference, kv)

    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(2, free_port(), path, out, device), nprocs=2, join=True, start_method="spawn")
    leader, follower = (pickle.load(open(f"{out}.{r}", "rb")) for r in range(2))
    assert leader["tokens"] == expected
    assert leader["after_drop"] == expected  # the dropped key's batches ran eagerly on both ranks
    assert leader["compared"] == expected and leader["comparisons"] > 0
    assert [len(t) for t in expected] == MAX_TOKENS
    assert follower["stats"] == leader["stats"]
    assert sum(n for k, n in leader["stats"]["replays"].items() if k.startswith("full")) > 0
    assert sum(n for k, n in leader["stats"]["replays"].items() if k.startswith("piecewise")) > 0
    assert follower["captured"] == leader["captured"] and len(leader["captured"]) == len(reference.keys) - 1
    assert follower["commands"] > sum(MAX_TOKENS) // len(MAX_TOKENS)  # a pass per engine step, at least


class RecordedChannel:
    """In-process stand-in for the gloo group: rank 0's sends queue up for a follower that runs later
    (:meth:`follower`: the same queue, rank 1's side)."""

    def __init__(self, sent: list | None = None, rank: int = 0, gathered: list | None = None) -> None:
        self.rank = rank
        self.sent: list[tuple] = [] if sent is None else sent
        self.gathered = gathered or []  # what rank 0 hears from the other ranks in a gather
        self.closing = threading.Event()

    def follower(self) -> RecordedChannel:
        return RecordedChannel(self.sent, rank=1)

    def send(self, *command) -> None:
        self.sent.append(pickle.loads(pickle.dumps(command)))  # what crosses the wire: copies

    def receive(self) -> tuple:
        return self.sent.pop(0)

    def gather(self, value) -> list | None:  # the follower runs later: rank 0 hears itself and ``gathered``
        return [value, *self.gathered] if self.rank == 0 else None


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def _own_runner(tiny) -> GraphRunner:
    """A graph runner over ``tiny`` and a KV cache of its own (not captured yet)."""
    return _runner(tiny, _kv(tiny))


def _pair(tiny) -> tuple[RecordedChannel, GraphRunner, GraphRunner, LeaderRunner]:
    """(channel, rank 0's own runner, the follower's runner, rank 0's LeaderRunner), in one process;
    a rank-0 failure in a sent command raises :class:`GroupBroken` instead of ending the process."""
    channel, leader_local, follower = RecordedChannel(), _own_runner(tiny), _own_runner(tiny)
    return channel, leader_local, follower, LeaderRunner(leader_local, channel, on_failure=_raise)


def test_a_follower_runs_rank_0s_commands_in_order_and_stops(tiny):
    channel, leader_local, follower, leader = _pair(tiny)
    with torch.inference_mode():
        leader.capture_all()
    tokens = _generate(tiny, leader, leader_local.kv_caches)
    leader.stop_followers()
    commands = [c[0] for c in channel.sent]
    assert commands[0] == "capture_all" and commands[-1] == "stop" and "execute" in commands
    assert follow(follower, channel.follower()) == len(commands) - 1
    assert _stats(follower) == _stats(leader_local)
    assert all(torch.equal(a, b) for a, b in zip(follower.kv_caches, leader_local.kv_caches))  # same passes, same K/V
    assert [len(t) for t in tokens] == MAX_TOKENS


def test_a_follower_refuses_a_decision_its_own_keys_would_not_make(tiny):
    channel, leader_local, follower, leader = _pair(tiny)
    with torch.inference_mode():
        leader.capture_all()
        follower.capture_all()
    channel.sent.clear()  # the follower captured on its own
    # the decode batches of all 5 requests (more than the largest FULL size, 4) replay piecewise-t8
    five = next(k for k in follower.captured_keys() if k.label() == "piecewise-t8")
    follower.drop(five, "only on this rank")  # a per-rank decision: the bug
    _generate(tiny, leader, leader_local.kv_caches)
    leader.stop_followers()
    refused = r"rank 0 dispatched a batch of 5 tokens to piecewise-t8, this rank to eager \(not_captured\)"
    with pytest.raises(RankDivergenceError, match=refused):
        follow(follower, channel.follower())


def test_an_online_canary_divergence_on_rank_0_drops_the_key_on_every_rank(tiny, monkeypatch):
    channel, leader_local, follower, leader = _pair(tiny)
    with torch.inference_mode():
        leader.capture_all()
    diverged = []
    canary = OnlineCanary(CanaryThresholds(sample_rate=1.0), torch.float32,
                          on_divergence=lambda key, result: diverged.append(key))
    leader.online_canary = canary
    assert leader.online_canary is canary  # the wrapper stays inside
    real = online_canary.compare_logits
    monkeypatch.setattr(online_canary, "compare_logits",  # judge every replay a divergence
                        lambda key, *a, **k: real(key, *a, **k).__class__(key, False, 1.0, 0.0, 1, 1, 0.0, 0.0, 0.0,
                                                                          reason="forced by the test"))
    _generate(tiny, leader, leader_local.kv_caches)
    leader.stop_followers()
    assert [c[0] for c in channel.sent].count("verdict") == len(diverged) > 0
    follow(follower, channel.follower())
    assert set(follower.diverged) == set(leader_local.diverged) == set(diverged)
    assert follower.captured_keys() == leader_local.captured_keys()
    assert _stats(follower) == _stats(leader_local)
    assert all(torch.equal(a, b) for a, b in zip(follower.kv_caches, leader_local.kv_caches))
    assert leader.resident_view(None) is None and leader.resident_decode_view(None) is None


class GroupBroken(Exception):
    pass


def _raise(command: str, exc: BaseException) -> None:
    raise GroupBroken(f"{command}: {exc}")


def test_a_rank_0_failure_inside_a_sent_command_goes_to_the_failure_policy(tiny):
    assert LeaderRunner(_own_runner(tiny), RecordedChannel()).on_failure is exit_group  # the default: exit 1
    channel = RecordedChannel()
    local = _own_runner(tiny)
    leader = LeaderRunner(local, channel, on_failure=_raise)

    def out_of_memory(meta):
        raise RuntimeError("CUDA out of memory (rank 0 only)")

    local.run_eager = out_of_memory
    with pytest.raises(GroupBroken, match=r"execute: CUDA out of memory \(rank 0 only\)"):
        leader.execute(_decode_meta(tiny))
    assert [c[0] for c in channel.sent] == ["execute"]  # sent before rank 0 failed: the followers are in it
    channel.closing.set()  # rank 0 is stopping the group (ranks.stop): a failure now is the stop's
    with pytest.raises(RuntimeError, match="CUDA out of memory") as raised:
        leader.execute(_decode_meta(tiny))
    assert type(raised.value) is RuntimeError  # rank 0's own error, not the policy's


def _decode_meta(tiny):
    from graphserving.runtime.graphs.canary import canary_batch_for
    from graphserving.runtime.graphs.key import full_key

    key = full_key(2, GraphKeyContract(model_revision="test", dtype="float32"))
    return canary_batch_for(key, list(range(1, 9)), LIMITS.block_size, tiny.config.vocab_size, 64, "cpu",
                            torch.Generator().manual_seed(0))


def test_a_key_captured_on_some_ranks_only_is_dropped_on_every_rank(tiny):
    probe = _own_runner(tiny)
    keys = list(probe.keys)
    lost_on_follower, lost_on_leader = keys[0], keys[-1]
    follower_has = {k: 0 for k in keys if k != lost_on_follower}  # what the follower reports after its capture
    channel = RecordedChannel(gathered=[follower_has])

    def fault(key):
        if key == lost_on_leader:
            raise RuntimeError("out of memory (simulated)")

    kv = allocate_kv_cache(tiny.config, LIMITS.num_kv_blocks, LIMITS.block_size, torch.float32, "cpu")
    local = GraphRunner(tiny.model, kv, mode=GraphMode.FULL_AND_PIECEWISE, full_sizes=[1, 2, 4],
                        piecewise_sizes=[8, 16, 32, 64], contract=probe.contract,
                        max_blocks_per_seq=probe.max_blocks_per_seq, capture_fault=fault)
    leader = LeaderRunner(local, channel, on_failure=_raise)
    with torch.inference_mode():
        results = leader.capture_all()
    drops = [c[1] for c in channel.sent if c[0] == "drop"]
    assert set(drops) == {lost_on_follower, lost_on_leader}
    assert lost_on_follower not in local.captured_keys() and lost_on_leader not in local.captured_keys()
    assert next(r for r in results if r.key == lost_on_follower).error == "capture failed on rank 1"
    assert len(local.captured_keys()) == len(keys) - 2


def test_the_canary_fills_its_context_on_every_rank(tiny):
    channel, leader_local, follower, leader = _pair(tiny)
    with torch.inference_mode():
        leader.capture_all()
        key = leader_local.captured_keys()[0]
        result = run_canary(leader, key, list(range(1, 40)), LIMITS.block_size, 128, CanaryThresholds(),
                            torch.Generator().manual_seed(3))
    leader.stop_followers()
    assert result.passed
    assert [c[0] for c in channel.sent] == ["capture_all", "randomize_blocks", "run_eager", "replay", "stop"]
    follow(follower, channel.follower())
    assert all(torch.equal(a, b) for a, b in zip(follower.kv_caches, leader_local.kv_caches))
