"""The only place that issues collectives during training: group averaging behind a small interface.

A :class:`Communicator` sums a flat buffer over one group of ranks, asynchronously, and returns a
handle to wait on. :class:`ProcessGroupCommunicator` does it with ``torch.distributed`` (gloo or
NCCL, same code); tests substitute their own implementation to observe or delay the exchange.
"""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Protocol

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


class ProcessGroupCommunicator:
    """Collectives on ``torch.distributed`` with one sub-group per distinct topology group.

    All sub-groups are created up front, in the topology's fixed order, on every rank of
    ``process_group`` (``torch.distributed.new_group`` is itself collective). Topology rank ``i`` is
    rank ``i`` of ``process_group``. The exchanges run on sub-groups of their own, even a group of
    every rank, so that :func:`release_exchange_groups` can shut down exactly the threads that
    touched the optimizer's buffers.
    """

    def __init__(self, topology: Topology, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if topology.world_size != self.world_size:
            raise ValueError(
                f"topology is built for {topology.world_size} ranks but the process group has "
                f"{self.world_size}"
            )
        self._groups: dict[Group, dist.ProcessGroup] = {}
        for group in topology.distinct_groups():
            handle = dist.new_group([self._global_rank(r) for r in group])
            if self.rank in group:
                assert handle is not None
                self._groups[group] = handle
                _OWNED_GROUPS.append(handle)
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
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._groups[group], async_op=True)
        assert work is not None
        handle: Handle = work
        return handle

    def world_sum(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=self._global_rank(src), group=self.process_group)


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
        communicator._groups.clear()
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
