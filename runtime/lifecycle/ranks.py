"""The processes of a tensor-parallel worker: rank 0 starts one follower per other GPU and joins them.

``graphserving-worker --tensor-parallel-size N`` (``WorkerConfig.tensor_parallel_size``) is rank 0:
it serves HTTP, runs the engine and the lifecycle, and starts ranks ``1 .. N-1`` as child processes
(the same command with ``--tensor-parallel-rank R``, the resolved configuration in the environment),
each on GPU ``R`` (the CPU with gloo when the device is the CPU). All of them join one process
group:

- the model's collective (runtime/model/parallel.py): NCCL on CUDA, gloo on the CPU; NVLink
  multicast is switched off (``NCCL_NVLS_ENABLE=0``, ``NVSHMEM_DISABLE_NVLS=1``,
  ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, unless set): it can take a shared host's GPUs out of
  service;
- rank 0's commands (runtime/graphs/parallel.py) on a second group, gloo, whose timeout is long
  (:data:`COMMAND_TIMEOUT`): a follower waits in it while rank 0 has no requests.

A group lives and dies together. A follower dies with rank 0 (``PR_SET_PDEATHSIG``, set by the
follower itself first thing: :func:`follower_setup`); rank 0 exits with status 1 when a follower
dies unasked (:func:`watch`: the others would wait in a collective for ever), so its Pod restarts,
and when its own part of a command it sent fails (runtime/graphs/parallel.py). When rank 0's
lifecycle fails on its own (a check only rank 0 runs, say), it kills the followers, which may be
waiting in a collective, and stays up to report Failed (:func:`abandon`). On shutdown rank 0
sends ``stop`` (when nothing else can be sending commands), waits :data:`STOP_GRACE_S` for the
followers and kills the rest.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from graphserving.contract.worker_config import WorkerConfig
from ..graphs.parallel import CommandChannel
from ..model.parallel import ParallelLayout, TensorParallel

log = logging.getLogger(__name__)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""Environment every rank starts with unless already set (module docstring)."""
COMMAND_TIMEOUT = dt.timedelta(days=365)
"""The command group's timeout: a follower waits in it for as long as the worker is idle."""
JOIN_TIMEOUT = dt.timedelta(minutes=10)
"""The model group's timeout: for the ranks to meet (each joins before it loads its share) and for
any one collective (torch's NCCL default), the first of which waits for every rank's load."""
STOP_GRACE_S = 10.0
"""How long rank 0 waits for its followers to exit after ``stop`` before it kills them."""
CONFIG_ENV = "GRAPHSERVING_WORKER_CONFIG"
PARENT_ENV = "GRAPHSERVING_TP_PARENT_PID"
"""Rank 0's pid, for a follower to check that it has not been orphaned before it asked to die with it."""


@dataclass
class RankGroup:
    """One rank's view of its tensor-parallel group.

    Attributes:
        layout: this rank's place; device: its device (``cuda:R``, or the CPU).
        parallel: the model's collective; channel: rank 0's commands.
        followers: rank 0 only: the child processes of ranks 1 .. N-1.
        stopping: set when rank 0 begins to stop the group (a follower's exit is then expected).
        abandoned: rank 0 killed the followers (:func:`abandon`); the group is not destroyed then.
    """

    layout: ParallelLayout
    device: torch.device
    parallel: TensorParallel
    channel: CommandChannel
    followers: list[subprocess.Popen] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False


def rank_device(device: torch.device, rank: int) -> torch.device:
    """GPU ``rank`` on CUDA (made the current device), else ``device``.

    Raises:
        RuntimeError: fewer CUDA devices than ``rank + 1``.
    """
    if device.type != "cuda":
        return device
    if rank >= torch.cuda.device_count():
        raise RuntimeError(f"tensor-parallel rank {rank} needs GPU {rank}; {torch.cuda.device_count()} visible")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def connect(address: str, world_size: int) -> dist.TCPStore:
    """A follower: rank 0's rendezvous store at ``address`` (``HOST:PORT``)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=JOIN_TIMEOUT)


def join(layout: ParallelLayout, store: dist.Store, device: torch.device) -> RankGroup:
    """Join the group that meets at ``store`` (rank 0's) as ``layout.rank``.

    Blocks until every rank has joined (at most :data:`JOIN_TIMEOUT`).
    """
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    device = rank_device(device, layout.rank)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=layout.rank,
                            world_size=layout.tensor_parallel_size, timeout=JOIN_TIMEOUT,
                            **({"device_id": device} if cuda else {}))
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    log.info("tensor-parallel rank %d of %d joined on %s", layout.rank, layout.tensor_parallel_size, device)
    return RankGroup(layout, device, TensorParallel(layout), CommandChannel(commands, layout.rank))


def start(config: WorkerConfig, device: torch.device, log_level: str) -> RankGroup:
    """Rank 0: open the rendezvous store (on a loopback port the kernel picks), start the followers
    (this interpreter, ``graphserving.runtime.worker``), join them, and watch them (:func:`watch`)."""
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    env = {**os.environ, CONFIG_ENV: config.model_dump_json(exclude_unset=True),  # the fields set, as set
           PARENT_ENV: str(os.getpid())}
    followers = [
        subprocess.Popen([sys.executable, "-m", "graphserving.runtime.worker", "--tensor-parallel-rank", str(rank),
                          "--tensor-parallel-address", address, "--log-level", log_level],
                         env=env, stdin=subprocess.DEVNULL)
        for rank in range(1, size)
    ]
    log.info("started tensor-parallel ranks 1-%d (pids %s)", size - 1, ", ".join(str(p.pid) for p in followers))
    stopping = threading.Event()
    watch(followers, stopping, on_death=lambda rank, code: os._exit(1))  # also while they join
    try:
        group = join(ParallelLayout(size, 0), store, device)
    except BaseException:
        stopping.set()
        _kill(followers)
        raise
    group.followers, group.stopping = followers, stopping
    return group


def watch(followers: list[subprocess.Popen], stopping: threading.Event, on_death: Callable[[int, int], None],
          interval_s: float = 0.5) -> threading.Thread:
    """Rank 0: a daemon thread that calls ``on_death(rank, exit status)`` (after an error log) when
    a follower exits before ``stopping`` is set (:func:`stop`)."""
    def poll() -> None:
        while not stopping.is_set():
            for rank, proc in enumerate(followers, start=1):
                code = proc.poll()
                if code is not None and not stopping.is_set():
                    log.error("tensor-parallel rank %d exited with status %d: the group cannot go on; exiting",
                              rank, code)
                    on_death(rank, code)
                    return
            time.sleep(interval_s)

    thread = threading.Thread(target=poll, name="tensor-parallel-watch", daemon=True)
    thread.start()
    return thread


def abandon(group: RankGroup, reason: str) -> None:
    """Rank 0: kill the followers (they may be inside a collective rank 0 will never enter) and
    stop watching them; rank 0 stays up (its lifecycle reports Failed)."""
    log.error("tensor-parallel group abandoned (%s): killing ranks 1-%d", reason, len(group.followers))
    group.stopping.set()
    group.abandoned = True
    _kill(group.followers)


def stop(group: RankGroup, send_stop: Callable[[], None] | None) -> None:
    """Rank 0: end the group. ``send_stop`` (the graph runner's ``stop_followers``; None when lifecycle
    work may still be talking to them) ends their command loops; followers still running after
    :data:`STOP_GRACE_S` are killed. A command still in flight (the lifecycle's capture or canary)
    then fails without the failure policy's exit (``CommandChannel.closing``)."""
    group.stopping.set()
    group.channel.closing.set()
    if group.abandoned:  # the followers are gone: a broadcast to them would fail inside gloo at exit
        send_stop = None
    if send_stop is not None:  # in a thread: a follower stuck elsewhere would block the broadcast
        threading.Thread(target=_quietly, args=(send_stop,), name="tensor-parallel-stop", daemon=True).start()
    deadline = time.monotonic() + (STOP_GRACE_S if send_stop is not None else 0.0)
    for proc in group.followers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    if _kill(group.followers) or send_stop is None:
        group.abandoned = True  # a killed peer: destroying the group would abort the process
    leave(group)


def leave(group: RankGroup) -> None:
    """Leave the process group: destroyed on the CPU (gloo) unless abandoned (its peers were killed:
    gloo aborts); with NCCL the process's exit releases it (destroying a communicator that captured
    graphs used can hang, the known shutdown hang class)."""
    if group.device.type != "cuda" and not group.abandoned:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def exit_now(code: int) -> None:
    """End a rank's process once its work is done: logs and output flushed, then ``os._exit``, so
    that the interpreter's teardown never runs the process group's C++ destructors (with a peer
    gone, gloo's can abort; after captured graphs, NCCL's can hang: the known shutdown hang)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception as exc:  # the followers are killed after the grace period anyway
        log.warning("could not send stop to the tensor-parallel ranks: %s", exc)


def _kill(procs: list[subprocess.Popen]) -> bool:
    """SIGKILL the processes still running; whether there were any."""
    killed = False
    for proc in procs:
        if proc.poll() is None:
            log.warning("tensor-parallel rank (pid %d) did not exit: killed", proc.pid)
            proc.kill()
            proc.wait()
            killed = True
    return killed


def follower_setup(environ=os.environ) -> None:
    """First thing in a follower: SIGKILL when rank 0 dies (Linux prctl PR_SET_PDEATHSIG), and exit
    at once if it already has (the parent is no longer rank 0's pid). SIGINT and SIGTERM are left to
    rank 0, which drains and then stops the group in order: a terminal's Ctrl-C and many process
    managers (systemd's default kill mode, ``tini -g``, the dev node agent's ``killpg``) signal the
    whole process group, and a follower that died of it would make rank 0's watchdog end the
    group mid-drain. A follower still ends by rank 0's ``stop``, by the parent-death signal or by
    SIGKILL."""
    import ctypes

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    parent = environ.get(PARENT_ENV)
    if parent is not None and os.getppid() != int(parent):
        log.error("rank 0 (pid %s) is gone: exiting", parent)
        os._exit(1)
