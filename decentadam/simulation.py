"""n ranks of synchronous gossip in one process: exact simulation of decentralized training.

:class:`SimulatedCluster` gives each simulated rank a :class:`~decentadam.collectives.Communicator`
that sums the exchanges of :class:`~decentadam.DecentralizedAdam` in memory, so n optimizers in
one process run the same update code as n processes would, with no process group. It answers
"what would n workers do to my accuracy?" on one machine (and is how the worker-count study in
``benchmarks/parity`` runs 16 workers on 2 cores)::

    cluster = SimulatedCluster(4)
    models = [build_model() for _ in range(4)]
    optimizers = [
        DecentralizedAdam(m.parameters(),               # the default setting; 2 nodes of 2 ranks
                          comm=Comm(local_world_size=2, communicator=cluster.communicator(rank)))
        for rank, m in enumerate(models)                 # rank 0 first: it broadcasts its weights
    ]
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            loss_fn(model(x[rank]), y[rank]).backward()  # each rank's own batch
        for optimizer in optimizers:                     # lock step: every rank, in rank order
            optimizer.step()
    average = cluster.average([list(m.parameters()) for m in models])

The ranks must advance in lock step: every rank's ``step(t)`` (or, with ``Comm(overlap="backward")``,
every rank's backward of iteration ``t``) before any rank's iteration ``t + 1``, which is the
order in which a real run's exchanges complete. An exchange is summed, in rank order, when its
first member waits for it; waiting for one that a member has not started yet is a
:class:`RuntimeError` naming the ranks. A resumed optimizer (``load_state_dict``) cannot be
simulated: its first step starts an exchange of the loaded weights and waits for it at once, which
needs the other ranks running at the same time.

With ``Setting(intra_node="all_reduce")`` a rank's ``step()`` waits for its node's gradient sum: call
``start_gradient_sums()`` on every rank, in rank order, before any rank's ``step()`` (and keep
``overlap="step"``: in backward mode each bucket's hook waits for its sum during the backward).

Steps that wait for their own exchange before returning (``Setting(sync_steps=W)``, a resumed
optimizer's first step) need every member's step running at the same time: build the cluster with
``concurrent=True`` and call each rank's ``step()`` from its own thread, which
:meth:`SimulatedCluster.run` does (``cluster.run([opt.step for opt in optimizers])``); a wait then
blocks until the other members have started the exchange (at most ``timeout`` seconds), and
``average_parameters()`` and ``consensus_distance()`` work from such threads too. Sums still add
the members in rank order, so a run is the same whichever thread gets there first.

Otherwise collectives over every rank block until all ranks join, which one thread cannot do rank by rank:
use :meth:`SimulatedCluster.average` and :meth:`SimulatedCluster.consensus_distance` on all
ranks' tensors at once instead of the optimizers' ``average_parameters()`` and
``consensus_distance()``, which raise here.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import Tensor

from decentadam.collectives import NO_TIMEOUT, Handle
from decentadam.topology import Group

__all__ = ["SimulatedCluster", "SimulatedCommunicator"]


@dataclass(eq=False)
class _Exchange:
    """The k-th sum over one group: each member's tensor, summed once, when first waited for.

    bfloat16 and float16 tensors are added in float32 and rounded once: a pair's correctly rounded
    sum; gloo may add a larger group's low-precision values in another order, rounding some sums
    twice (``exchange="bf16_updates"`` on 4 gloo ranks stays within 1e-3 of this, see the tests)."""

    group: Group
    cluster: SimulatedCluster
    tensors: dict[int, Tensor] = field(default_factory=dict)
    done: bool = False

    def finish(self, waiting_rank: int) -> None:
        with self.cluster._lock:
            if self.cluster.concurrent:  # the other members start it from their own threads
                self.cluster._lock.wait_for(
                    lambda: len(self.tensors) == len(self.group) or self.cluster._failed,
                    timeout=self.cluster.timeout,
                )
            self._finish(waiting_rank)

    def _finish(self, waiting_rank: int) -> None:
        if self.done:
            return
        missing = [rank for rank in self.group if rank not in self.tensors]
        if missing:
            raise RuntimeError(
                f"simulated rank {waiting_rank} waits for the exchange of group {self.group}, but "
                f"rank(s) {missing} have not started it: step every simulated rank in rank order "
                "before any rank's next iteration (decentadam.simulation)"
            )
        first = self.tensors[self.group[0]]
        low = first.dtype in (torch.bfloat16, torch.float16)  # summed in float32, rounded once
        total = torch.zeros_like(first, dtype=torch.float32 if low else first.dtype)
        for rank in self.group:  # a fixed order: every member gets bitwise the same sum
            total.add_(self.tensors[rank])
        for tensor in self.tensors.values():
            tensor.copy_(total)
        self.done = True


@dataclass(eq=False)
class _SimulatedHandle:
    exchange: _Exchange
    rank: int

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> object:
        self.exchange.finish(self.rank)
        return True


class SimulatedCluster:
    """The in-memory meeting point of ``world_size`` simulated ranks (see the module docstring)."""

    def __init__(self, world_size: int, concurrent: bool = False, timeout: float = 600.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.concurrent, self.timeout = concurrent, timeout
        self._lock = threading.Condition()
        self._failed = False  # a rank's thread raised: the others stop waiting for it
        # (group, k) -> the k-th exchange over that group; each rank counts its own calls per group
        self._exchanges: dict[tuple[Group, int], _Exchange] = {}
        self._calls: list[dict[Group, int]] = [defaultdict(int) for _ in range(world_size)]
        self._broadcasts: list[list[Tensor]] = [[] for _ in range(world_size)]
        self._broadcasts_read = [0] * world_size

    def communicator(self, rank: int) -> SimulatedCommunicator:
        """The communicator to give the optimizer of simulated rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return SimulatedCommunicator(self, rank)

    def _group_sum(self, rank: int, tensor: Tensor, group: Group) -> Handle:
        if rank not in group:
            raise ValueError(f"rank {rank} is not a member of group {group}")
        with self._lock:
            k = self._calls[rank][group]
            self._calls[rank][group] = k + 1
            exchange = self._exchanges.setdefault((group, k), _Exchange(group, self))
            exchange.tensors[rank] = tensor
            if len(exchange.tensors) == len(group):  # every member has started it: no longer needed here
                del self._exchanges[(group, k)]
            self._lock.notify_all()
        return _SimulatedHandle(exchange, rank)

    def run(self, work: Sequence[Callable[[], None]]) -> None:
        """``concurrent=True``: run ``work[rank]`` (one rank's ``step()``, say) for every rank at once,
        each in its own thread, and return when all have; the first error is raised here."""
        if not self.concurrent:
            raise RuntimeError("SimulatedCluster.run needs SimulatedCluster(..., concurrent=True)")
        errors: list[BaseException] = []

        def call(fn: Callable[[], None]) -> None:
            try:
                fn()
            except BaseException as error:  # re-raised in the caller's thread
                errors.append(error)
                with self._lock:
                    self._failed = True
                    self._lock.notify_all()

        threads = [threading.Thread(target=call, args=(fn,), daemon=True) for fn in work]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _broadcast(self, rank: int, tensor: Tensor, src: int) -> None:
        with self._lock:
            self._broadcast_locked(rank, tensor, src)

    def _broadcast_locked(self, rank: int, tensor: Tensor, src: int) -> None:
        if rank == src:
            self._broadcasts[src].append(tensor.detach().clone())
            self._lock.notify_all()
            return
        index = self._broadcasts_read[rank]
        sent = self._broadcasts[src]
        if self.concurrent:
            self._lock.wait_for(lambda: index < len(sent) or self._failed, timeout=self.timeout)
        if index >= len(sent):
            raise RuntimeError(
                f"simulated rank {rank} receives broadcast #{index} from rank {src}, which has not sent "
                f"it: build (or step) rank {src} first"
            )
        tensor.copy_(sent[index])
        self._broadcasts_read[rank] = index + 1

    @staticmethod
    def average(tensors_per_rank: Sequence[Sequence[Tensor]]) -> list[Tensor]:
        """The exact average over ranks of each tensor: ``tensors_per_rank[rank][i]`` -> ``out[i]``."""
        per_tensor = zip(*tensors_per_rank, strict=True)
        return [torch.stack([t.detach() for t in same]).mean(0) for same in per_tensor]

    @staticmethod
    def consensus_distance(tensors_per_rank: Sequence[Sequence[Tensor]], relative: bool = False) -> float:
        """mean over ranks of ``||x_i - x_bar||^2`` over all tensors (float64), as the optimizer's."""
        distance = norm = 0.0
        for same in zip(*tensors_per_rank, strict=True):
            stacked = torch.stack([t.detach().double().reshape(-1) for t in same])  # (ranks, numel)
            mean = stacked.mean(0)
            distance += float((stacked - mean).square().sum(1).mean())
            norm += float(mean.square().sum())
        if relative:
            return distance / norm if norm > 0 else 0.0
        return distance


class SimulatedCommunicator:
    """One simulated rank's view of a :class:`SimulatedCluster` (a ``Communicator``)."""

    def __init__(self, cluster: SimulatedCluster, rank: int) -> None:
        self.cluster, self.rank, self.world_size = cluster, rank, cluster.world_size

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        return self.cluster._group_sum(self.rank, tensor, group)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        self.cluster._broadcast(self.rank, tensor, src)

    def world_sum(self, tensor: Tensor) -> None:
        if self.cluster.concurrent:  # the other ranks join from their own threads
            self.group_sum(tensor, tuple(range(self.world_size))).wait()
            return
        raise RuntimeError(
            "a sum over every simulated rank would block this rank until the others join, which one "
            "thread cannot do: use SimulatedCluster.average() or SimulatedCluster.consensus_distance() "
            "on all ranks' tensors instead of average_parameters() / consensus_distance()"
        )
