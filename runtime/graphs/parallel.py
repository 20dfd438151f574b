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
  the same counts, and drops a key (a canary's verdict, judged on rank 0) everywhere at once;
- the online canary's draw for a pass is rank 0's, sent with the batch; a sampled replay's eager
  pass then runs on every rank (it all-reduces too), and rank 0 sends its verdict
  (:class:`LeaderCanary`, :class:`FollowerCanary`), so a diverged key leaves dispatch on every
  rank in the same step.

Commands travel over a CPU process group (gloo) as pickled tuples
(``torch.distributed.broadcast_object_list``); the batch travels as host tensors (unpadded
``ForwardMetadata``, a few hundred bytes per request).

Not yet under tensor parallelism: device-resident runs (multi-step decoding's and speculative
verification's in-place advance of a key's static buffers: :meth:`LeaderRunner.resident_view`
returns None, so the model runner runs each step as its own pass).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..model.forward_metadata import ForwardMetadata
from .canary import CanaryResult
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

    def send(self, *command) -> None:
        """Rank 0: broadcast ``command`` (picklable values; tensors on the host)."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} cannot send commands: only rank 0 decides")
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


class LeaderRunner:
    """Rank 0's graph runner: :class:`GraphRunner`'s calls that run the model, sent to the followers first.

    Implements what the model runner (``engine.model_runner.GraphExecutor``) and the lifecycle use of a
    graph runner; every other attribute (keys, captures, stats, enabled, mode ...) is read from
    ``local``.

    Args:
        local: rank 0's own graph runner.
        channel: to the followers.
    """

    def __init__(self, local: GraphRunner, channel: CommandChannel) -> None:
        self.__dict__["local"] = local
        self.__dict__["channel"] = channel
        self.__dict__["follower_memory"] = {}  # key -> bytes its graphs take on the other ranks together

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
        self.channel.send("execute", on_host(meta), decision, drawn)
        return self.local.execute(meta, decision)

    def run_eager(self, meta: ForwardMetadata) -> torch.Tensor:
        self.channel.send("run_eager", on_host(meta))
        return self.local.run_eager(meta)

    def replay(self, key: GraphKey, meta: ForwardMetadata) -> torch.Tensor:
        self.channel.send("replay", key, on_host(meta))
        return self.local.replay(key, meta)

    def capture_all(self, progress: Callable[[int, int, KeyCapture], None] | None = None) -> list[KeyCapture]:
        """As :meth:`GraphRunner.capture_all`; then every rank tells rank 0 what its graphs take."""
        self.channel.send("capture_all")
        results = self.local.capture_all(progress)
        memory: dict[GraphKey, int] = {}
        for theirs in self.channel.gather({})[1:]:
            for key, size in theirs.items():
                memory[key] = memory.get(key, 0) + size
        self.__dict__["follower_memory"] = memory
        return results

    def graph_memory_bytes(self) -> int:
        """What the graphs of the keys rank 0 still replays take on every rank together (bytes)."""
        return sum(c.memory_bytes + self.follower_memory.get(key, 0)
                   for key, c in list(self.local.captures.items()) if c.ok)

    def drop(self, key: GraphKey, reason: str) -> None:
        self.channel.send("drop", key, reason)
        self.local.drop(key, reason)

    def invalidate(self, reason: str) -> None:
        self.channel.send("invalidate", reason)
        self.local.invalidate(reason)

    def disable(self, reason: FallbackReason) -> None:
        self.channel.send("disable", reason)
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
        self.channel.send("reconfigure", mode, list(full_sizes), list(piecewise_sizes), num_speculative_tokens)
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
