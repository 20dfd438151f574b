"""Graph runners of a tensor-parallel group: rank 0 decides, every other rank does the same.

Under tensor parallelism (runtime/model/parallel.py) every forward pass of a rank's model
all-reduces with the other ranks, inside captured graphs as well as eagerly. A collective only
completes when every rank enters it with the same shapes, so the seed's rules for captured
collectives (docs/architecture.md, "Tensor parallelism") become one protocol here:

- only rank 0 runs the engine (scheduler, sampler, block manager) and the lifecycle; its graph
  runner is wrapped in a :class:`LeaderRunner`, which sends every call that runs the model, captures,
  drops or reconfigures (the *command*) to the other ranks before running it locally;
- every other rank runs :func:`follow`: the same calls on its own :class:`GraphRunner` (its share of
  the model and its own KV cache of the same block count), in the same order;
- the graph key of a pass is rank 0's dispatch decision, sent with the batch; a follower checks that
  its own pure decision (:meth:`GraphRunner.plan`) agrees and raises
  :class:`RankDivergenceError` otherwise (its captured keys differ: a bug, caught before a collective
  could hang on it);
- so every rank captures the same keys in the same order, replays the same key each step, pads to
  the same counts, and drops a key (a canary's verdict, judged on rank 0) everywhere at once; after
  a capture every rank tells rank 0 which keys it captured, and a key missing on any rank is
  dropped on all of them;
- a rank-0 failure inside a command it has sent (an out-of-memory halfway through a pass, say)
  leaves the followers inside that command's collectives, where no later pass can meet them: the
  group cannot go on, and :class:`LeaderRunner` ends the process (status 1, as when a follower
  dies: runtime/lifecycle/ranks.py), so the Pod restarts instead of serving from a hung group;
- the online canary's draw for a pass is rank 0's, sent with the batch; a sampled replay's eager
  pass then runs on every rank (it all-reduces too), and rank 0 sends its verdict
  (:class:`LeaderCanary`, :class:`FollowerCanary`), so a diverged key leaves dispatch on every
  rank in the same step.

Commands travel over a CPU process group (gloo) as pickled tuples
(``torch.distributed.broadcast_object_list``), from one thread at a time (a lock); the batch
travels as host tensors (unpadded ``ForwardMetadata``: per request its tokens' ids, positions and
slots and its block-table row, 4 bytes per KV block). Putting a device batch on the host
synchronises the stream: under tensor parallelism a pass is never queued behind the previous one.

Not yet under tensor parallelism: device-resident runs (multi-step decoding's and speculative
verification's in-place advance of a key's static buffers: :meth:`LeaderRunner.resident_view`
returns None, so the model runner runs each step as its own pass); a capture that fails inside
its own collective on one rank (the others wait in it) cannot be mended by the reconciliation
above.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

import torch

from ..model.forward_metadata import ForwardMetadata
from .canary import CanaryResult, randomize_blocks
from .key import Dispatch, FallbackReason, GraphKey
from .online_canary import OnlineCanary
from .runner import GraphRunner, KeyCapture

log = logging.getLogger(__name__)


class RankDivergenceError(RuntimeError):
    """A follower's graph runner would have dispatched a pass differently from rank 0."""


class CommandChannel:
    """Rank 0's commands to the other ranks of a group, in order.

    Args:
        group: a CPU-capable ``torch.distributed`` process group of the tensor-parallel ranks (gloo);
            None: the default group.
        rank: this process's rank in it; 0 sends, the others receive.
    """

    def __init__(self, group=None, rank: int | None = None) -> None:
        self.group = group
        self.rank = torch.distributed.get_rank(group) if rank is None else rank
        self._lock = threading.Lock()  # two threads' broadcasts would interleave on the wire
        self.closing = threading.Event()
        """Set on rank 0 once it has begun to end the group (``lifecycle.ranks.stop``): a sent command
        that fails after that failed because the followers are going, not for a fault of rank 0's."""

    def send(self, *command) -> None:
        """Rank 0: broadcast ``command`` (picklable values; tensors on the host)."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} cannot send commands: only rank 0 decides")
        with self._lock:
            torch.distributed.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> tuple:
        """Another rank: the next command rank 0 sent (blocks until it comes)."""
        box: list = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value) -> list | None:
        """Every rank: ``value`` (picklable) to rank 0, which gets the list by rank; the others None."""
        size = torch.distributed.get_world_size(self.group)
        out = [None] * size if self.rank == 0 else None
        torch.distributed.gather_object(value, out, dst=0, group=self.group)
        return out


def on_host(meta: ForwardMetadata) -> ForwardMetadata:
    """``meta`` with its tensors on the host, copied before this returns (a device batch is synchronised)."""
    if meta.input_ids.device.type == "cpu":
        return meta
    host = meta.to("cpu")
    torch.cuda.current_stream(meta.input_ids.device).synchronize()
    return host


class LeaderCanary:
    """Rank 0's online canary: each pass's draw made before the pass is sent (:meth:`draw`), each
    verdict sent to the followers before anything else happens (``on_divergence`` runs after it).
    Other attributes (tallies, totals) are the wrapped canary's."""

    def __init__(self, canary: OnlineCanary, channel: CommandChannel) -> None:
        self.canary, self.channel, self.drawn = canary, channel, False

    def __getattr__(self, name: str):
        return getattr(self.canary, name)

    def draw(self) -> bool:
        """The draw for the next pass (sent with it); its replay's :meth:`sampled` returns it."""
        self.drawn = self.canary.sampled()
        return self.drawn

    def sampled(self) -> bool:
        drawn, self.drawn = self.drawn, False
        return drawn

    def judge(self, key: GraphKey, graph: torch.Tensor, eager: torch.Tensor) -> CanaryResult:
        callback, self.canary.on_divergence = self.canary.on_divergence, None
        try:
            result = self.canary.judge(key, graph, eager)
        finally:
            self.canary.on_divergence = callback
        self.channel.send("verdict", result.passed, result.reason)
        if not result.passed and callback is not None:
            callback(key, result)
        return result


class FollowerCanary:
    """A follower's online canary: rank 0's draw for the pass (:attr:`drawn`, set from its command)
    and rank 0's verdict (received in :meth:`judge`)."""

    def __init__(self, channel: CommandChannel) -> None:
        self.channel, self.drawn = channel, False

    def sampled(self) -> bool:
        drawn, self.drawn = self.drawn, False
        return drawn

    def reset(self, thresholds=None) -> None:
        """Nothing to forget: the tallies are rank 0's."""

    def judge(self, key: GraphKey, graph: torch.Tensor, eager: torch.Tensor) -> CanaryResult:
        """Rank 0's verdict on the replay both ranks just compared.

        Raises:
            RankDivergenceError: rank 0 sent another command where its verdict was due.
        """
        name, *args = self.channel.receive()
        if name != "verdict":
            raise RankDivergenceError(f"rank 0 sent {name!r} where its online canary's verdict on {key.label()} was due")
        passed, reason = args
        return CanaryResult(key, passed, 0.0, 0.0, 0, 0, 0.0, 0.0, 0.0, reason=reason)


def exit_group(command: str, exc: BaseException) -> None:
    """The default :class:`LeaderRunner` failure policy: log and end the process with status 1."""
    log.critical("tensor parallelism: rank 0 failed inside %r after sending it (%s: %s); the other ranks are "
                 "left inside its collectives and the group cannot go on: exiting", command, type(exc).__name__, exc)
    logging.shutdown()
    os._exit(1)


class LeaderRunner:
    """Rank 0's graph runner: :class:`GraphRunner`'s calls that run the model, sent to the followers first.

    Implements what the model runner (``engine.model_runner.GraphExecutor``) and the lifecycle use of a
    graph runner; every other attribute (keys, captures, stats, enabled, mode ...) is read from
    ``local`` (reads only: a call that changes ``local``'s keys must be a command here).

    Args:
        local: rank 0's own graph runner.
        channel: to the followers.
        on_failure: called with (command, exception) when rank 0's own part of a sent command raises
            (module docstring); default :func:`exit_group`. Tests pass one that raises.
    """

    def __init__(self, local: GraphRunner, channel: CommandChannel,
                 on_failure: Callable[[str, BaseException], None] = exit_group) -> None:
        self.__dict__["local"] = local
        self.__dict__["channel"] = channel
        self.__dict__["on_failure"] = on_failure
        self.__dict__["follower_memory"] = {}  # key -> bytes its graphs take on the other ranks together

    @contextlib.contextmanager
    def _sent(self, name: str, *args) -> Iterator[None]:
        """Send command ``name`` with ``args``, then run rank 0's part (the ``with`` body) under the
        failure policy (which ends the process by default; a test's policy raises), unless the
        channel is closing (rank 0 is stopping the group: the exception just propagates)."""
        self.channel.send(name, *args)
        try:
            yield
        except Exception as exc:
            if not self.channel.closing.is_set():  # else the group is ending: no failure of its own
                self.on_failure(name, exc)
            raise

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "online_canary" and value is not None:
            value = LeaderCanary(value, self.channel)
        setattr(self.local, name, value)

    @property
    def online_canary(self) -> OnlineCanary | None:
        canary = self.local.online_canary
        return canary.canary if canary is not None else None

    def execute(self, meta: ForwardMetadata) -> tuple[torch.Tensor, Dispatch]:
        """As :meth:`GraphRunner.execute`, with the decision (and the online canary's draw) rank 0's
        and sent with the batch."""
        decision = self.local.plan(meta)
        canary = self.local.online_canary
        drawn = canary.draw() if canary is not None and decision.key is not None else False
        with self._sent("execute", on_host(meta), decision, drawn):
            return self.local.execute(meta, decision)

    def run_eager(self, meta: ForwardMetadata) -> torch.Tensor:
        with self._sent("run_eager", on_host(meta)):
            return self.local.run_eager(meta)

    def replay(self, key: GraphKey, meta: ForwardMetadata) -> torch.Tensor:
        with self._sent("replay", key, on_host(meta)):
            return self.local.replay(key, meta)

    def randomize_blocks(self, block_ids: list[int], generator: torch.Generator) -> None:
        """Random K/V in ``block_ids`` on every rank (the canary's context, runtime/graphs/canary.py):
        each rank fills its own heads from a seed drawn from ``generator``."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with self._sent("randomize_blocks", list(block_ids), seed):
            randomize_blocks(self.local.kv_caches, block_ids, torch.Generator().manual_seed(seed))

    def capture_all(self, progress: Callable[[int, int, KeyCapture], None] | None = None) -> list[KeyCapture]:
        """As :meth:`GraphRunner.capture_all`; then every rank tells rank 0 which keys it captured
        and what their graphs take, and a key missing on any rank is dropped on every rank."""
        with self._sent("capture_all"):
            results = self.local.capture_all(progress)
            theirs = self.channel.gather({})[1:]
        memory: dict[GraphKey, int] = {}
        for rank_memory in theirs:
            for key, size in rank_memory.items():
                memory[key] = memory.get(key, 0) + size
        self.__dict__["follower_memory"] = memory
        for result in results:
            missing = [rank for rank, rank_memory in enumerate(theirs, start=1) if result.key not in rank_memory]
            if result.ok and missing:
                self.drop(result.key, f"capture failed on rank {', '.join(map(str, missing))}")
            elif not result.ok and any(result.key in rank_memory for rank_memory in theirs):
                self.drop(result.key, result.error or "capture failed on rank 0")
        return results

    def graph_memory_bytes(self) -> int:
        """What the graphs of the keys rank 0 still replays take on every rank together (bytes)."""
        return sum(c.memory_bytes + self.follower_memory.get(key, 0)
                   for key, c in list(self.local.captures.items()) if c.ok)

    def drop(self, key: GraphKey, reason: str) -> None:
        with self._sent("drop", key, reason):
            self.local.drop(key, reason)

    def invalidate(self, reason: str) -> None:
        with self._sent("invalidate", reason):
            self.local.invalidate(reason)

    def disable(self, reason: FallbackReason) -> None:
        with self._sent("disable", reason):
            self.local.disable(reason)

    def reconfigure(self, mode, full_sizes, piecewise_sizes, *, capture_fault=None,
                    num_speculative_tokens: int | None = None) -> None:
        """As :meth:`GraphRunner.reconfigure`.

        Raises:
            ValueError: a ``capture_fault`` (a test hook): a capture failing on one rank alone would
                leave the others inside the key's collective.
        """
        if capture_fault is not None:
            raise ValueError("capture faults cannot be injected under tensor parallelism: a key failing on rank 0 "
                             "alone would leave the other ranks inside its collective")
        with self._sent("reconfigure", mode, list(full_sizes), list(piecewise_sizes), num_speculative_tokens):
            self.local.reconfigure(mode, full_sizes, piecewise_sizes, num_speculative_tokens=num_speculative_tokens)

    def resident_decode_view(self, meta: ForwardMetadata) -> None:
        """None: device-resident runs are not mirrored yet (module docstring); each step is a pass."""
        return None

    def resident_view(self, meta: ForwardMetadata) -> None:
        """None, as :meth:`resident_decode_view`."""
        return None

    def stop_followers(self) -> None:
        """End every follower's :func:`follow` loop."""
        self.channel.send("stop")


def follow(runner: GraphRunner, channel: CommandChannel) -> int:
    """A follower's loop: run rank 0's commands on ``runner`` until ``stop``; returns the commands run.

    Raises:
        RankDivergenceError: ``runner`` would dispatch a batch differently from rank 0.
        ValueError: an unknown command (rank 0 runs another version of this module).
    """
    done = 0
    runner.online_canary = FollowerCanary(channel)
    with torch.inference_mode():
        while True:
            name, *args = channel.receive()
            if name == "stop":
                return done
            _run(runner, channel, name, args)
            done += 1


def _run(runner: GraphRunner, channel: CommandChannel, name: str, args: list) -> None:
    """One command of :func:`follow` (the tensors of a batch go to ``runner``'s device)."""
    if name == "execute":
        meta, decision, drawn = args
        runner.online_canary.drawn = drawn
        mine = runner.plan(meta)
        if mine != decision:
            raise RankDivergenceError(f"rank 0 dispatched a batch of {meta.num_tokens} tokens to {_label(decision)}, "
                                      f"this rank to {_label(mine)}: the ranks' captured keys differ")
        runner.execute(meta, decision)
    elif name == "run_eager":
        runner.run_eager(args[0].to(runner.device))
    elif name == "replay":
        runner.replay(args[0], args[1])
    elif name == "capture_all":
        channel.gather({c.key: c.memory_bytes for c in runner.capture_all() if c.ok})
    elif name == "randomize_blocks":
        block_ids, seed = args
        randomize_blocks(runner.kv_caches, block_ids, torch.Generator().manual_seed(seed))
    elif name == "drop":
        runner.drop(*args)
    elif name == "invalidate":
        runner.invalidate(*args)
    elif name == "disable":
        runner.disable(*args)
    elif name == "reconfigure":
        mode, full, piecewise, spec = args
        runner.reconfigure(mode, full, piecewise, num_speculative_tokens=spec)
    else:
        raise ValueError(f"unknown tensor-parallel command {name!r}")


def _label(decision: Dispatch) -> str:
    return decision.key.label() if decision.key is not None else f"eager ({decision.reason.value})"
