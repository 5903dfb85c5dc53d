"""The one path from the exchanges to the communicator: start a group sum, wait for it, count it,
and explain a failure (a peer that died or stalled) with the step, the group and the kind."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from torch import Tensor

from decentadam.collectives import CommStats, Communicator, ExchangeGroupsReleased, Handle
from decentadam.topology import Group, Topology

__all__ = ["Link", "Pending"]


@dataclass(eq=False)
class Pending:
    """A sum whose result one step folds in: its handle and its group's size ``q``."""

    handle: Handle | None = None  # the sum in flight
    size: int = 0  # q > 1: the buffer holds (or will hold) the sum over a group of q ranks


@dataclass(eq=False)
class Link:
    """A rank's communicator, its schedule, its counters and its timeout, for every exchange kind."""

    communicator: Communicator
    topology: Topology
    rank: int
    world_size: int
    timeout: timedelta  # NO_TIMEOUT: the process group's
    stats: CommStats
    clock: Callable[[], int]  # the optimizer's step count t: the step of the exchange being waited for

    def start(self, tensor: Tensor, group: Group, step: int, kind: str, *, counted: bool = False) -> Handle:
        """Start summing ``tensor`` over ``group`` for step ``step``; its bytes count as sent, and
        with ``counted`` the exchange counts as one of the exchanges."""
        with self.explain(step, "start", kind):
            handle = self.communicator.group_sum(tensor, group)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        if counted:
            self.stats.exchanges += 1
        return handle

    def wait(self, handle: Handle, kind: str, timeout: timedelta | None = None) -> None:
        """Block until ``handle``'s sum is done (at most ``timeout``, default the link's)."""
        start = time.perf_counter()
        with self.explain(self.clock(), "finish", kind):  # in flight: the exchange for step t
            handle.wait(self.timeout if timeout is None else timeout)
        self.stats.wait_seconds += time.perf_counter() - start

    def take(self, pending: Pending, kind: str, timeout: timedelta | None = None) -> int:
        """Wait for ``pending``'s sum if one is there and mark it taken: its group's size q (0 or 1:
        nothing pending)."""
        q, pending.size = pending.size, 0
        if q > 1 and pending.handle is not None:
            handle, pending.handle = pending.handle, None
            self.wait(handle, kind, timeout)
        return q

    @contextlib.contextmanager
    def explain(self, step: int, what: str, kind: str) -> Iterator[None]:
        """Re-raise a failed collective with what it was for and what probably happened."""
        try:
            yield
        except ExchangeGroupsReleased:
            raise
        except RuntimeError as error:
            limit = f"{self.timeout.total_seconds():g} s" if self.timeout else "the process group's timeout"
            raise RuntimeError(
                f"rank {self.rank}: the {kind} exchange for step {step} with ranks "
                f"{self.topology.group_of(self.rank, step)} did not {what} "
                f"(waited at most {limit}); a peer process probably died or stalled. Check the other "
                f"ranks' logs. Cause: {error}"
            ) from error
