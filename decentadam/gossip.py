"""The only place that issues collectives during training: group averaging behind a small interface.

A :class:`Communicator` sums a flat buffer over one group of ranks, asynchronously, and returns a
handle to wait on. :class:`ProcessGroupCommunicator` does it with ``torch.distributed`` (gloo or
NCCL, same code); tests substitute their own implementation to observe or delay the exchange.

A group made of whole nodes (AER's inter-node rounds, ``complete`` on several nodes) is summed
hierarchically: the ranks of each node reduce-scatter the buffer over the fast intra-node link,
rank ``l`` of every node all-reduces shard ``l`` with rank ``l`` of the group's other nodes, and each
node all-gathers the shards. Every node link then carries ``2 (m-1)/m * S`` per direction for ``m``
nodes (``S`` for a pair of nodes), where one ring over all ``m L`` ranks carries
``2 (mL-1)/(mL) * S`` (``1.5 S`` for two nodes of two ranks). The three phases run in a pipeline of
three threads, each with its own process groups, in the order the exchanges were started.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from decentadam.topology import Group, Topology, whole_nodes

__all__ = [
    "NO_TIMEOUT",
    "Communicator",
    "Handle",
    "ProcessGroupCommunicator",
    "SingleProcessCommunicator",
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


class ProcessGroupCommunicator:
    """Collectives on ``torch.distributed`` with one sub-group per distinct topology group.

    All sub-groups are created up front, in the topology's fixed order, on every rank of
    ``process_group`` (``torch.distributed.new_group`` is itself collective). Topology rank ``i`` is
    rank ``i`` of ``process_group``. With ``hierarchical=True`` groups of whole nodes are summed in
    the three phases of the module docstring (buffers whose length is not a multiple of the ranks
    per node fall back to one all-reduce).
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
        self.local_world_size = topology.local_world_size
        self._groups: dict[Group, dist.ProcessGroup] = {}
        self._shard_groups: dict[Group, dist.ProcessGroup] = {}  # group -> this rank's cross-node group
        for group in topology.distinct_groups():
            if len(group) == self.world_size:
                handle = process_group if process_group is not None else dist.group.WORLD
            else:
                handle = self._new_group(group)
            if self.rank in group:
                assert handle is not None
                self._groups[group] = handle
        self._pipeline: _Pipeline | None = None
        hierarchical_groups = [
            (g, nodes)
            for g in topology.distinct_groups()
            if hierarchical and (nodes := whole_nodes(g, self.local_world_size)) is not None
        ]
        if hierarchical_groups:
            # One reduce-scatter and one all-gather group per node (each used by one pipeline
            # thread only, so each sees the exchanges in start order), one group per shard.
            size = self.local_world_size
            node_groups = [tuple(range(j, j + size)) for j in range(0, self.world_size, size)]
            mine = self.rank // size
            scatter = [self._new_group(node) for node in node_groups][mine]
            gather = [self._new_group(node) for node in node_groups][mine]
            for group, nodes in hierarchical_groups:
                for local in range(size):
                    shard_handle = self._new_group(tuple(node[local] for node in nodes))
                    if self.rank in group and self.rank % size == local:
                        self._shard_groups[group] = shard_handle
            self._pipeline = _Pipeline(scatter, gather, self.rank % size, size)

    def _new_group(self, group: Group) -> dist.ProcessGroup:
        handle: dist.ProcessGroup = dist.new_group([self._global_rank(r) for r in group])
        return handle

    def _global_rank(self, rank: int) -> int:
        if self.process_group is None:
            return rank
        return dist.get_global_rank(self.process_group, rank)

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        shards = self._shard_groups.get(group)
        if shards is not None and self._pipeline is not None and tensor.numel() % self.local_world_size == 0:
            return self._pipeline.submit(tensor, shards)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._groups[group], async_op=True)
        assert work is not None
        handle: Handle = work
        return handle

    def world_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=self._global_rank(src), group=self.process_group)


# torch 2.13 renamed these (the old names warn); torch < 2.13 has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class _Job:
    """One hierarchical group sum going through the pipeline."""

    tensor: Tensor
    shard_group: dist.ProcessGroup
    shard: Tensor | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> object:
        if not self.done.wait(timeout.total_seconds() or None):
            raise RuntimeError(f"the hierarchical group sum did not finish within {timeout}")
        if self.error is not None:
            raise RuntimeError(f"the hierarchical group sum failed: {self.error}") from self.error
        return True


class _Pipeline:
    """Reduce-scatter in the node -> all-reduce of the shard across nodes -> all-gather in the node.

    Three daemon threads, one per phase, each taking jobs in submission order; blocking collectives
    release the GIL, so phases of different buckets overlap each other and the training thread.
    """

    def __init__(
        self, scatter: dist.ProcessGroup, gather: dist.ProcessGroup, local_rank: int, local_size: int
    ) -> None:
        self.local_rank, self.local_size = local_rank, local_size
        self.submitted = 0  # group sums taken hierarchically
        self._scatter_group, self._gather_group = scatter, gather
        self._queues: list[queue.SimpleQueue[_Job]] = [queue.SimpleQueue() for _ in range(3)]
        phases = (self._scatter, self._across, self._gather)
        for index, phase in enumerate(phases):
            thread = threading.Thread(
                target=self._run, args=(index, phase), name=f"decentadam-hierarchical-{index}", daemon=True
            )
            thread.start()

    def submit(self, tensor: Tensor, shard_group: dist.ProcessGroup) -> _Job:
        job = _Job(tensor, shard_group)
        self.submitted += 1
        self._queues[0].put(job)
        return job

    def _run(self, index: int, phase: object) -> None:
        assert callable(phase)
        while True:
            job = self._queues[index].get()
            if job.error is None:
                try:
                    phase(job)
                except BaseException as error:  # reported to whoever waits for the job
                    job.error = error
            if index + 1 < len(self._queues):
                self._queues[index + 1].put(job)
            else:
                job.done.set()

    def _scatter(self, job: _Job) -> None:
        job.shard = torch.empty(
            job.tensor.numel() // self.local_size, dtype=job.tensor.dtype, device=job.tensor.device
        )
        _reduce_scatter(job.shard, job.tensor, group=self._scatter_group)

    def _across(self, job: _Job) -> None:
        assert job.shard is not None
        dist.all_reduce(job.shard, group=job.shard_group)

    def _gather(self, job: _Job) -> None:
        assert job.shard is not None
        _all_gather(job.tensor, job.shard, group=self._gather_group)
        job.shard = None
