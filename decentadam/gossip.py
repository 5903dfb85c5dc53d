"""The only place that issues collectives during training: group averaging behind a small interface.

A :class:`Communicator` sums a flat buffer over one group of ranks, asynchronously, and returns a
handle to wait on. :class:`ProcessGroupCommunicator` does it with ``torch.distributed`` (gloo or
NCCL); tests substitute their own implementation to observe or delay the exchange.

Groups that span several nodes with the same number ``m >= 2`` of ranks on each (AER's node-pair
groups, ``complete`` on a multi-rank-per-node cluster) are summed hierarchically on gloo: a
reduce-scatter inside each node (``m`` shards), an all-reduce of each shard across the nodes (one
"rail" per shard index), an all-gather inside each node; the two phases inside a node are direct
sends. A node's link then carries ``S`` per
direction for a two-node group instead of the ``2 (2m-1)/(2m) S`` of one flat ring over all its
members. NCCL groups keep NCCL's own all-reduce (the chained path is tested on gloo only).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from decentadam.topology import Group, Topology

logger = logging.getLogger(__name__)

__all__ = [
    "NO_TIMEOUT",
    "Communicator",
    "ExchangeGroupsReleased",
    "Handle",
    "ProcessGroupCommunicator",
    "SingleProcessCommunicator",
    "release_exchange_groups",
]

NO_TIMEOUT = timedelta(0)
"""``Handle.wait(NO_TIMEOUT)`` waits as long as the process group allows (torch's convention)."""


class Handle(Protocol):
    """An exchange in flight."""

    def wait(self, timeout: timedelta = ...) -> object:
        """Block until the exchange has finished writing its result (raise after ``timeout``)."""
        ...


class Communicator(Protocol):
    """Collectives the decentralized optimizer needs, over topology rank numbers."""

    rank: int
    world_size: int

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        """Start summing ``tensor`` in place over ``group`` (which contains ``rank``); async."""
        ...

    def world_sum(self, tensor: Tensor) -> None:
        """Sum ``tensor`` in place over every rank; returns when done."""
        ...

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s; returns when done."""
        ...


class ExchangeGroupsReleased(RuntimeError):
    """An exchange was started after :func:`release_exchange_groups` shut the groups down."""


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


@dataclass(frozen=True)
class _Hierarchy:
    """How this rank takes part in the hierarchical sum of one group."""

    local_index: int  # this rank's position among its node's members of the group: its shard
    local_size: int  # m: the group's ranks on every node it spans
    peers: tuple[int, ...]  # global ranks of this node's members of the group, in local order
    scatter: dist.ProcessGroup  # this node's members: reduce-scatter sends (issued by the caller's thread)
    rail: dist.ProcessGroup  # shard ``local_index`` of every node: all-reduce (issued by the driver)
    gather: dist.ProcessGroup  # this node's members again: all-gather sends (issued by the driver)


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
    every rank, so that :func:`release_exchange_groups` can shut down exactly the threads that
    touched the optimizer's buffers.

    ``hierarchical`` (default on) sums multi-node groups of CPU tensors in three phases (module
    docstring). The caller's thread starts the reduce-scatter; a driver thread per communicator
    waits for it and chains the all-reduce across nodes and the all-gather, so the exchange still
    travels while the caller computes, and one bucket's all-gather overlaps the next bucket's
    all-reduce across nodes. Every phase has process groups of its own, used by one thread in the
    order the caller started the exchanges, so all ranks issue each group's collectives in the
    same order.
    """

    def __init__(
        self,
        topology: Topology,
        process_group: dist.ProcessGroup | None = None,
        *,
        hierarchical: bool = True,
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
        self._groups: dict[Group, dist.ProcessGroup] = {}
        self._hierarchy: dict[Group, _Hierarchy] = {}
        made: dict[tuple[str, Group], dist.ProcessGroup | None] = {}

        def new_group(kind: str, members: Group) -> dist.ProcessGroup | None:
            # Called on every rank in the same order; one process group per (kind, members).
            if (kind, members) not in made:
                handle = dist.new_group([self._global_rank(r) for r in members])
                made[kind, members] = handle
                if self.rank in members:
                    assert handle is not None
                    _OWNED_GROUPS.append(handle)
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
        self._shards: dict[tuple[int, int, torch.dtype], Tensor] = {}
        self._driver: threading.Thread | None = None
        self._chains: queue.SimpleQueue[_Chain | None] = queue.SimpleQueue()
        _LIVE_COMMUNICATORS.add(self)

    def _global_rank(self, rank: int) -> int:
        if self.process_group is None:
            return rank
        return dist.get_global_rank(self.process_group, rank)

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        if not self._groups:
            raise ExchangeGroupsReleased(
                "the exchange groups were released (at interpreter exit, or by release_exchange_groups()); "
                "build a new DecentralizedAdam to train again"
            )
        plan = self._hierarchy.get(group)
        if plan is not None and tensor.device.type == "cpu" and tensor.numel() >= plan.local_size:
            return self._hierarchical_sum(tensor, group, plan)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._groups[group], async_op=True)
        assert work is not None
        handle: Handle = work
        return handle

    def _hierarchical_sum(self, tensor: Tensor, group: Group, plan: _Hierarchy) -> Handle:
        m, j = plan.local_size, plan.local_index
        shard_numel = tensor.numel() // m
        body = tensor[: shard_numel * m]
        key = (tensor.data_ptr(), shard_numel, tensor.dtype)
        scratch = self._shards.get(key)
        if scratch is None:  # one per bucket buffer: a buffer has one exchange in flight at a time
            scratch = self._shards[key] = torch.empty(m - 1, shard_numel, dtype=tensor.dtype)
        shards = body.view(m, shard_numel)
        chain = _Chain(shards, scratch, plan)
        # Reduce-scatter inside the node as direct sends (gloo's own reduce_scatter copies the whole
        # input at launch and is slower than an all-reduce): member k gets shard k of every member,
        # and the rows of ``scratch`` receive the other members' copies of this rank's shard.
        others = [(k, peer) for k, peer in enumerate(plan.peers) if k != j]
        for row, (k, peer) in zip(scratch, others, strict=True):
            chain.scatter.append(dist.irecv(row, src=peer, group=plan.scatter))
            chain.scatter.append(dist.isend(shards[k], dst=peer, group=plan.scatter))
        if body.numel() < tensor.numel():  # the last numel % m elements: a flat sum of the group
            chain.tail = dist.all_reduce(tensor[body.numel() :], group=self._groups[group], async_op=True)
        if self._driver is None:
            self._driver = threading.Thread(
                target=_drive, args=(self._chains,), name="decentadam-exchange", daemon=True
            )
            self._driver.start()
        self._chains.put(chain)
        return chain

    def _stop_driver(self) -> None:
        if self._driver is not None:
            self._chains.put(None)
            self._driver.join(timeout=60)
            self._driver = None

    def world_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=self._global_rank(src), group=self.process_group)


@dataclass(eq=False)
class _Chain:
    """One hierarchical exchange: the handle the caller waits on, and the driver's work list."""

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


def _drive(chains: queue.SimpleQueue[_Chain | None]) -> None:
    """Chain each exchange's phases, in the order the caller started them (one thread per communicator)."""
    while True:
        chain = chains.get()
        if chain is None:
            return
        try:
            plan = chain.plan
            assert plan is not None
            j, mine = plan.local_index, chain.shards[plan.local_index]
            for work in chain.scatter:
                work.wait()
            for row in chain.scratch:  # this node's sum of shard j, in place in the buffer
                mine.add_(row)
            rail = dist.all_reduce(mine, group=plan.rail, async_op=True)
            assert rail is not None
            rail.wait()
            for k, peer in enumerate(plan.peers):  # all-gather: shard k comes from member k
                if k != j:
                    chain.gathered.append(dist.irecv(chain.shards[k], src=peer, group=plan.gather))
                    chain.gathered.append(dist.isend(mine, dst=peer, group=plan.gather))
        except BaseException as error:  # handed to the caller's wait()
            chain.error = error
        finally:
            chain.started.set()
        chain = plan = rail = None  # hold no work or group between exchanges


_OWNED_GROUPS: list[dist.ProcessGroup] = []  # every exchange group this process created and still holds
_LIVE_COMMUNICATORS: weakref.WeakSet[ProcessGroupCommunicator] = weakref.WeakSet()


def release_exchange_groups() -> None:
    """Shut down the exchange groups and let go of them, so that their worker threads end now.

    Call it only when no exchange is in flight (the optimizer waits for them at exit, then calls
    this). A gloo worker thread can still hold a finished exchange's buffer for a moment after
    ``wait()`` returned; if that moment falls into interpreter shutdown, the thread's release of the
    buffer needs the GIL, and the process aborts ("terminate called without an active exception";
    1 of 30 runs of the tests' 4-process Accelerate loop, after it had waited for its exchanges).
    Destroying the groups joins those threads while the interpreter is still whole.
    """
    # Each group's destructor joins its threads once nothing holds it: not the communicators, not
    # this module, not torch.distributed (destroy_process_group unregisters it).
    for communicator in list(_LIVE_COMMUNICATORS):
        communicator._stop_driver()
        communicator._groups.clear()
        communicator._hierarchy.clear()
        communicator._shards.clear()
    owned = list(_OWNED_GROUPS)
    _OWNED_GROUPS.clear()
    if dist.is_initialized():  # else the user destroyed every group already
        for group in owned:
            try:
                dist.destroy_process_group(group)
            except ValueError:  # "Invalid process group specified": the user destroyed it already
                pass
            except RuntimeError as error:  # a backend that fails to shut down: nothing left to save
                logger.warning("decentadam: could not shut down an exchange group at exit: %s", error)
