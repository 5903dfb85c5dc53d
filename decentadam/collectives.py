"""Collectives of decentralized training behind a small interface, and the one home of their costs.

A :class:`Communicator` sums a flat buffer over one group of ranks, asynchronously, and returns a
handle to wait on. :class:`ProcessGroupCommunicator` does it with ``torch.distributed`` (gloo or
NCCL); tests substitute their own implementation to observe or delay the exchange. This module
issues every collective of training; which groups average at which step is
:mod:`decentadam.topology`'s business, and when buffers are sent and mixed is the optimizer's.

Hierarchical sums. A group that spans several nodes with the same number ``m >= 2`` of ranks on
each (AER's node-pair groups, ``complete`` on a multi-rank-per-node cluster) is summed on gloo in
three phases: a reduce-scatter inside each node (``m`` shards, direct sends), an all-reduce of each
shard across the nodes (one "rail" process group per shard index), and an all-gather inside each
node (direct sends). For a bucket of ``S`` bytes, a node's link then carries ``S`` per direction
for a two-node group, against ``2 (2m-1)/(2m) S`` for one flat ring over all the group's members
(1.5 S for ``m = 2``). The cost is a scratch buffer of ``(m-1)/m`` of each bucket: the other
members' copies of this rank's shard. NCCL groups and CUDA tensors keep one all-reduce per group
(the chained path is tested on gloo only). :mod:`decentadam.runtime_model` prices the same phases.

Lifecycle. A :class:`ProcessGroupCommunicator` creates process groups and, for hierarchical sums,
a driver thread; :meth:`ProcessGroupCommunicator.close` waits for its exchanges in flight and
shuts both down. :mod:`decentadam.shutdown` closes every communicator still open at interpreter
exit, as a fallback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from decentadam import distributed, shutdown
from decentadam.topology import Group, Topology

logger = logging.getLogger(__name__)

__all__ = [
    "NO_TIMEOUT",
    "Closable",
    "CommStats",
    "Communicator",
    "ExchangeGroupsReleased",
    "Handle",
    "ProcessGroupCommunicator",
    "SingleProcessCommunicator",
    "WorldCollectives",
    "WorldCommunicator",
    "default_communicator",
    "node_layout",
]

NO_TIMEOUT = timedelta(0)
"""``Handle.wait(NO_TIMEOUT)`` waits as long as the process group allows (torch's convention)."""

CLOSE_TIMEOUT = timedelta(seconds=60)
"""How long :meth:`ProcessGroupCommunicator.close` waits for each exchange in flight by default."""


@dataclass
class CommStats:
    """Counters of the exchange, cumulative since construction (reset with ``reset()``).

    Attributes:
        wait_seconds: time spent blocked waiting for exchanges to arrive (communication that the
            forward/backward did not hide).
        bytes_sent: bytes this rank contributed to group sums: parameters, and with
            ``second_moment="group_gradient"`` its gradient sums (bfloat16 in a group of two,
            float32 in a larger one).
        exchanges: number of bucket exchanges started.
        steps: optimizer steps taken by this process (a resume does not add the checkpoint's).
    """

    wait_seconds: float = 0.0
    bytes_sent: int = 0
    exchanges: int = 0
    steps: int = 0

    def reset(self) -> None:
        self.wait_seconds, self.bytes_sent, self.exchanges, self.steps = 0.0, 0, 0, 0

    def snapshot(self) -> CommStats:
        """A copy of the counters now, to measure what happens from here on."""
        return replace(self)


class Handle(Protocol):
    """An exchange in flight."""

    def wait(self, timeout: timedelta = ...) -> object:
        """Block until the exchange has finished writing its result (raise after ``timeout``)."""
        ...


class WorldCollectives(Protocol):
    """Collectives over every rank: the consensus model, metrics and checkpoints need only these."""

    rank: int
    world_size: int

    def world_sum(self, tensor: Tensor) -> None:
        """Sum ``tensor`` in place over every rank; returns when done."""
        ...

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s; returns when done."""
        ...


class Communicator(WorldCollectives, Protocol):
    """Collectives the decentralized optimizer needs, over topology rank numbers."""

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        """Start summing ``tensor`` in place over ``group`` (which contains ``rank``); async."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A communicator that holds resources (process groups, threads) to release with ``close()``."""

    def close(self) -> None:
        """Wait for the exchanges in flight, then release the resources; idempotent."""
        ...


class ExchangeGroupsReleased(RuntimeError):
    """An exchange was started after the communicator was closed."""


class _Done:
    def wait(self, timeout: timedelta = NO_TIMEOUT) -> object:
        return True


class SingleProcessCommunicator:
    """world_size 1: every collective is the identity."""

    rank = 0
    world_size = 1

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        return _Done()

    def world_sum(self, tensor: Tensor) -> None:
        return None

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        return None

    def close(self) -> None:
        return None


class WorldCommunicator:
    """:class:`WorldCollectives` on one process group, nothing else (asynchronous gossip exchanges
    by its own means, see :mod:`decentadam.asynchronous.a2cid2`). Rank ``i`` is rank ``i`` of
    ``process_group``."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)

    def world_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        global_src = src if self.process_group is None else dist.get_global_rank(self.process_group, src)
        dist.broadcast(tensor, src=global_src, group=self.process_group)


@dataclass(frozen=True)
class _Hierarchy:
    """How this rank takes part in the hierarchical sum of one group."""

    local_index: int  # this rank's position among its node's members of the group: its shard
    local_size: int  # m: the group's ranks on every node it spans
    peers: tuple[int, ...]  # global ranks of this node's members of the group, in local order
    scatter: dist.ProcessGroup  # this node's members: reduce-scatter sends (issued by the caller's thread)
    rail: dist.ProcessGroup  # shard ``local_index`` of every node: all-reduce (issued by the driver)
    gather: dist.ProcessGroup  # this node's members again: all-gather sends (issued by the driver)


def default_communicator(
    topology: Topology,
    param_groups: Sequence[dict[str, Any]],
    process_group: dist.ProcessGroup | None,
    hierarchical: bool,
    close_timeout: timedelta,
    extra_groups: Sequence[Group] = (),
) -> Communicator:
    """The optimizer's communicator: none for one rank, else one on ``torch.distributed``.

    Checks first that every rank holds the same parameters (the buckets are built from them).
    ``extra_groups``: groups summed besides the topology's (the nodes, for gradients).
    """
    if topology.world_size == 1:
        return SingleProcessCommunicator()
    distributed.check_same_parameters([group["params"] for group in param_groups], process_group)
    # the three-phase sums run on CPU tensors only: for CUDA parameters their extra process groups
    # would be built (a gloo connection per pair) and never used
    on_cpu = all(p.device.type == "cpu" for group in param_groups for p in group["params"])
    return ProcessGroupCommunicator(
        topology,
        process_group,
        hierarchical=hierarchical and on_cpu,
        close_timeout=close_timeout,
        extra_groups=extra_groups,
    )


def node_layout(group: Group, local_world_size: int) -> list[Group] | None:
    """The group's members per node when it can be summed hierarchically, else ``None``.

    That is when it spans at least two nodes with the same number (at least 2) of members on each.
    """
    if local_world_size < 2:
        return None
    parts: dict[int, list[int]] = {}
    for rank in group:
        parts.setdefault(rank // local_world_size, []).append(rank)
    sizes = {len(members) for members in parts.values()}
    if len(parts) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    return [tuple(parts[node]) for node in sorted(parts)]


class ProcessGroupCommunicator:
    """Collectives on ``torch.distributed`` with one sub-group per distinct topology group.

    All sub-groups are created up front, in the topology's fixed order, on every rank of
    ``process_group`` (``torch.distributed.new_group`` is itself collective). Topology rank ``i`` is
    rank ``i`` of ``process_group``. The exchanges run on sub-groups of their own, even a group of
    every rank, so that :meth:`close` shuts down exactly the threads that touched the exchanged
    buffers.

    ``hierarchical`` (default on; never with NCCL) sums multi-node groups of CPU tensors in three
    phases (module docstring). The caller's thread starts the reduce-scatter; a driver thread per
    communicator waits for it and chains the all-reduce across nodes and the all-gather, so the
    exchange still travels while the caller computes. Every phase has process groups of its own,
    used by one thread in the order the caller started the exchanges, so all ranks issue each
    group's collectives in the same order.

    Every exchange started by :meth:`group_sum` is tracked until it is waited for, so that
    :meth:`close` (or :func:`decentadam.shutdown.close_all` at exit) lets it finish before the
    groups go. ``close_timeout`` bounds that wait per exchange. After an exchange failed, ``close``
    keeps the groups: a gloo thread may still be stuck on a dead peer, and shutting its group down
    would wait for it.
    """

    def __init__(
        self,
        topology: Topology,
        process_group: dist.ProcessGroup | None = None,
        *,
        hierarchical: bool = True,
        close_timeout: timedelta = CLOSE_TIMEOUT,
        extra_groups: Sequence[Group] = (),
    ) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if topology.world_size != self.world_size:
            raise ValueError(
                f"topology is built for {topology.world_size} ranks but the process group has "
                f"{self.world_size}"
            )
        self.hierarchical = hierarchical and dist.get_backend(process_group) != "nccl"
        self.close_timeout = close_timeout
        self._groups: dict[Group, dist.ProcessGroup] = {}
        self._hierarchy: dict[Group, _Hierarchy] = {}
        self._owned: list[dist.ProcessGroup] = []  # every group this communicator created and holds
        self._in_flight: dict[_Tracked, None] = {}  # started, not yet waited for (insertion order)
        self._failed = False  # an exchange failed to start or finish
        self._closed = False
        made: dict[tuple[str, Group], dist.ProcessGroup | None] = {}

        def new_group(kind: str, members: Group) -> dist.ProcessGroup | None:
            # Called on every rank in the same order; one process group per (kind, members).
            if (kind, members) not in made:
                handle = dist.new_group([self._global_rank(r) for r in members])
                made[kind, members] = handle
                if self.rank in members:
                    assert handle is not None
                    self._owned.append(handle)
            return made[kind, members] if self.rank in members else None

        for group in topology.distinct_groups():
            handle = new_group("caller", group)
            if handle is not None:
                self._groups[group] = handle
            nodes = node_layout(group, topology.local_world_size) if self.hierarchical else None
            if nodes is None:
                continue
            # point-to-point phases get groups of their own, apart from the groups' all-reduces
            scatter = [new_group("scatter", members) for members in nodes]
            rails = [new_group("rail", tuple(members[j] for members in nodes)) for j in range(len(nodes[0]))]
            gather = [new_group("gather", members) for members in nodes]
            for members, mine_scatter, mine_gather in zip(nodes, scatter, gather, strict=True):
                if self.rank in members:
                    j = members.index(self.rank)
                    rail = rails[j]
                    assert mine_scatter is not None and mine_gather is not None and rail is not None
                    peers = tuple(self._global_rank(r) for r in members)
                    self._hierarchy[group] = _Hierarchy(
                        j, len(members), peers, mine_scatter, rail, mine_gather
                    )
        for group in extra_groups:  # after the topology's, in the caller's order: the same on every rank
            handle = new_group("caller", group) if len(group) > 1 else None  # one per members, as above
            if handle is not None:
                self._groups[group] = handle
        self._shards: dict[tuple[int, int, torch.dtype], Tensor] = {}
        self._driver: threading.Thread | None = None
        self._exchanges: queue.SimpleQueue[_HierarchicalExchange | None] = queue.SimpleQueue()
        shutdown.register(self)

    @property
    def hierarchical_groups(self) -> list[Group]:
        """The groups of this rank that are summed in three phases, sorted."""
        return sorted(self._hierarchy)

    @property
    def in_flight(self) -> int:
        """How many exchanges were started and not yet waited for."""
        return len(self._in_flight)

    def _global_rank(self, rank: int) -> int:
        if self.process_group is None:
            return rank
        return dist.get_global_rank(self.process_group, rank)

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        if self._closed:
            raise ExchangeGroupsReleased(
                "the exchange groups were released (by close(), or at interpreter exit); build a new "
                "DecentralizedAdam to train again"
            )
        try:
            plan = self._hierarchy.get(group)
            if plan is not None and tensor.device.type == "cpu" and tensor.numel() >= plan.local_size:
                handle = self._hierarchical_sum(tensor, group, plan)
            else:
                work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._groups[group], async_op=True)
                assert work is not None
                handle = work
        except RuntimeError:
            self._failed = True
            raise
        tracked = _Tracked(handle, self)
        self._in_flight[tracked] = None
        return tracked

    def _hierarchical_sum(self, tensor: Tensor, group: Group, plan: _Hierarchy) -> Handle:
        m, j = plan.local_size, plan.local_index
        shard_numel = tensor.numel() // m
        body = tensor[: shard_numel * m]
        key = (tensor.data_ptr(), shard_numel, tensor.dtype)
        scratch = self._shards.get(key)
        if scratch is None:  # one per bucket buffer: a buffer has one exchange in flight at a time
            scratch = self._shards[key] = torch.empty(m - 1, shard_numel, dtype=tensor.dtype)
        shards = body.view(m, shard_numel)  # (m, numel // m): row k is shard k
        exchange = _HierarchicalExchange(shards, scratch, plan)
        # Reduce-scatter inside the node as direct sends (gloo's own reduce_scatter copies the whole
        # input at launch and is slower than an all-reduce): member k gets shard k of every member,
        # and the rows of ``scratch`` receive the other members' copies of this rank's shard.
        others = [(k, peer) for k, peer in enumerate(plan.peers) if k != j]
        for row, (k, peer) in zip(scratch, others, strict=True):
            exchange.scatter.append(dist.irecv(row, src=peer, group=plan.scatter))
            exchange.scatter.append(dist.isend(shards[k], dst=peer, group=plan.scatter))
        if body.numel() < tensor.numel():  # the last numel % m elements: a flat sum of the group
            exchange.tail = dist.all_reduce(tensor[body.numel() :], group=self._groups[group], async_op=True)
        if self._driver is None:
            self._driver = threading.Thread(
                target=_run_phases, args=(self._exchanges,), name="decentadam-exchange", daemon=True
            )
            self._driver.start()
        self._exchanges.put(exchange)
        return exchange

    def world_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=self._global_rank(src), group=self.process_group)

    def close(self) -> None:
        """Let the exchanges in flight finish, then shut down the driver thread and the groups.

        Idempotent; :meth:`group_sum` raises :class:`ExchangeGroupsReleased` afterwards. A gloo worker
        thread can still hold a finished exchange's buffer for a moment after ``wait()`` returned; if
        that moment falls into interpreter shutdown, the thread's release of the buffer needs the
        GIL, and the process aborts ("terminate called without an active exception": 3 of 5 runs of
        the tests' 4-process Accelerate loop without the wait, 1 of 30 with the wait alone).
        Destroying the groups joins those threads while the interpreter is still whole.
        """
        if self._closed:
            return
        self._closed = True
        shutdown.unregister(self)
        try:
            for tracked in list(self._in_flight):
                tracked.wait(self.close_timeout)
        except RuntimeError as error:
            logger.warning("decentadam: exchanges in flight at close did not finish: %s", error)
            return
        if self._failed:  # a worker thread may still be stuck on a stalled peer
            return
        if self._driver is not None:
            self._exchanges.put(None)
            self._driver.join(timeout=60)
            self._driver = None
        # Each group's destructor joins its threads once nothing holds it: not this communicator,
        # not torch.distributed (destroy_process_group unregisters it).
        self._groups.clear()
        self._hierarchy.clear()
        self._shards.clear()
        owned, self._owned = self._owned, []
        if not dist.is_initialized():  # the user destroyed every group already
            return
        for group in owned:
            try:
                dist.destroy_process_group(group)
            except ValueError:  # "Invalid process group specified": the user destroyed it already
                pass
            except RuntimeError as error:  # a backend that fails to shut down: nothing left to save
                logger.warning("decentadam: could not shut down an exchange group: %s", error)


class _Tracked:
    """A handle of :class:`ProcessGroupCommunicator` that leaves its in-flight set once waited for."""

    __slots__ = ("_communicator", "_handle")

    def __init__(self, handle: Handle, communicator: ProcessGroupCommunicator) -> None:
        self._handle = handle
        self._communicator = communicator

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> object:
        try:
            return self._handle.wait(timeout)
        except RuntimeError:
            self._communicator._failed = True
            raise
        finally:
            self._communicator._in_flight.pop(self, None)


@dataclass(eq=False)
class _HierarchicalExchange:
    """One hierarchical group sum: the handle the caller waits on, and the driver's work list."""

    shards: Tensor  # (m, numel // m) view of the buffer: row k is shard k
    scratch: Tensor  # (m - 1, numel // m): the other members' copies of this rank's shard j
    plan: _Hierarchy | None  # dropped once finished: a handle kept by its bucket must not keep the groups
    scatter: list[Any] = field(default_factory=list)  # sends and receives of the reduce-scatter
    tail: Any = None  # flat all-reduce of the remainder, if any
    gathered: list[Any] = field(default_factory=list)  # sends and receives of the all-gather (driver)
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)  # the all-gather is issued
    finished: bool = False

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> object:
        if self.finished:  # waited for already (as torch's works, a handle may be waited on twice)
            return True
        deadline = None if timeout == NO_TIMEOUT else time.monotonic() + timeout.total_seconds()
        expired = RuntimeError(f"hierarchical group sum timed out after {timeout.total_seconds():g} s")

        def left() -> timedelta:
            if deadline is None:
                return NO_TIMEOUT
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise expired
            return timedelta(seconds=remaining)

        if not self.started.wait(None if deadline is None else left().total_seconds()):
            raise expired
        if self.error is not None:
            raise RuntimeError(f"hierarchical group sum failed: {self.error}") from self.error
        for work in self.gathered:
            work.wait(left())
        if self.tail is not None:
            self.tail.wait(left())
        self.scatter, self.gathered, self.tail, self.plan = [], [], None, None  # let go of works, groups
        self.finished = True
        return True


def _run_phases(exchanges: queue.SimpleQueue[_HierarchicalExchange | None]) -> None:
    """Chain each exchange's phases, in the order the caller started them (one thread per communicator)."""
    while True:
        exchange = exchanges.get()
        if exchange is None:
            return
        try:
            plan = exchange.plan
            assert plan is not None
            j, mine = plan.local_index, exchange.shards[plan.local_index]
            for work in exchange.scatter:
                work.wait()
            for row in exchange.scratch:  # this node's sum of shard j, in place in the buffer
                mine.add_(row)
            rail = dist.all_reduce(mine, group=plan.rail, async_op=True)
            assert rail is not None
            rail.wait()
            for k, peer in enumerate(plan.peers):  # all-gather: shard k comes from member k
                if k != j:
                    exchange.gathered.append(dist.irecv(exchange.shards[k], src=peer, group=plan.gather))
                    exchange.gathered.append(dist.isend(mine, dst=peer, group=plan.gather))
        except BaseException as error:  # handed to the caller's wait()
            exchange.error = error
        finally:
            exchange.started.set()
        exchange = plan = rail = None  # hold no work or group between exchanges
