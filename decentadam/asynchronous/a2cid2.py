r"""A2CiD2: asynchronous decentralized training with continuized momentum (Nabli et al., NeurIPS 2023).

Every rank takes gradient steps with a local optimizer (SGD with momentum, AccumAdamW, ...) at its
own pace and never waits for another rank. Beside the training loop, a background thread per rank
averages the parameters with one graph neighbour at a time, ``rate`` times per gradient step of
its own on average, at Poisson times. A2CiD2 adds a second variable ``x~`` per rank that the
continuized framework mixes with ``x`` between events; with it the averagings converge as if the
graph were better connected. Time ``t`` is counted in the rank's own gradient steps::

    between events, dt apart:  [x; x~] <- expm([[-eta, eta], [eta, -eta]] dt) [x; x~]
                               (x - x~ shrinks by exp(-2 eta dt), x + x~ is unchanged)
    gradient event:            x  <- x  - lr * D        D: the local optimizer's update direction
                               x~ <- x~ - lr * D        (the same delta)
    averaging with rank j:     x~ <- x~ + alpha~ (x_j - x_i)
                               x  <- x  + (x_j - x_i) / 2

with ``L = rate (I - W)`` the graph's Laplacian (:meth:`decentadam.asynchronous.graph.Graph.laplacian`),
``chi1 = 1 / lambda_2(L)``, ``chi2 = max over edges (i, j) of (e_i - e_j)^T L^+ (e_i - e_j) / 2``::

    eta = 1 / (2 sqrt(chi1 chi2)),    alpha~ = sqrt(chi1 / chi2) / 2

(:func:`continuized_constants`; a ring of 16 at rate 1: ``eta = 0.1425``, ``alpha~ = 1.872``).
``continuized=False`` drops ``x~``: plain asynchronous pairwise averaging (AD-PSGD without
its staleness handling).

Implementation notes.

- **State.** The optimizer stores ``y = x~ - x`` (one flat copy of the parameters), not ``x~``:
  gradient events leave ``y`` unchanged, so the local optimizer steps the parameters as usual and
  A2CiD2 adds only the mixing. Mixing becomes ``x += (1 - a)/2 * y; y *= a`` with
  ``a = exp(-2 eta dt)`` (:func:`continuized_mix_`), averaging ``x += d/2; y += (alpha~ - 1/2) d``
  with ``d = x_j - x_i`` (:func:`continuized_average_`).
- **Clock.** ``t`` is the number of completed gradient steps plus the elapsed fraction of the
  current one, estimated from the recent step durations (capped below 1): a gradient step always
  mixes up to exactly ``t = k + 1``, an averaging in between mixes up to its estimated time.
- **Exchange.** Two paired ranks (:mod:`decentadam.asynchronous.pairing` says how they pair and why)
  snapshot their parameters, swap the snapshots with point-to-point ``isend``/``irecv`` on a
  dedicated gloo process group, and each applies ``d = x_j^snapshot - x_i^snapshot``. The local
  steps taken during the swap are kept (``x`` gets ``d / 2`` added, it is not overwritten), so an
  averaging conserves the pair's sum of ``x`` and of ``x~`` exactly: the average over ranks moves
  only by gradient steps. The dedicated group keeps the background thread's traffic off the
  training's process group (whose collectives the main thread may issue at the same time); it is
  always gloo, with CPU staging buffers for CUDA parameters, because gloo point-to-point works from
  any thread without CUDA streams, and with NCCL two ranks cannot share a GPU.
- **Consistency model.** One lock orders the events of a rank: the local optimizer's step (with
  the mixing before it) and each averaging's snapshot and apply are atomic with respect to each
  other. Forward and backward do not take the lock: an averaging may change the parameters between
  a forward and its backward, or in the middle of a forward, as in the authors' implementation and in
  AD-PSGD. The thread writes through ``param.data``, so autograd does not object to the change
  (the backward then uses the new values). :meth:`A2CiD2.paused` (and :meth:`average_parameters`,
  :meth:`consensus_stats`, checkpoints) stop the averagings of this rank: no exchange in flight or
  pending, none starting; once every rank is paused the parameter sum is exact.
- **Memory.** ``y`` (one copy of the parameters) plus a send and a receive buffer (two more
  copies; in pinned CPU memory for CUDA parameters, with the device copy used for staging).

Lifecycle: construction broadcasts rank 0's parameters and starts the pairing thread (and the
matchmaker on rank 0), which asks for partners from the first :meth:`A2CiD2.step` on.
:meth:`A2CiD2.close` leaves the pairing, waits until every rank has left (a straggler finishing
its last steps, or an error if a rank died), then sets every rank's parameters to their exact
average: all ranks leave with the same model. :mod:`decentadam.shutdown` calls it at exit for an
optimizer never closed. A rank that dies makes every other rank's next :meth:`A2CiD2.step` (or
:meth:`A2CiD2.close`) raise :class:`~decentadam.asynchronous.pairing.PeerFailure` within ``timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.optim import Optimizer

from decentadam import buckets as bucketing
from decentadam import distributed, shutdown
from decentadam.asynchronous.continuized import (
    ContinuizedConstants,
    continuized_average_,
    continuized_constants,
    continuized_mix_,
)
from decentadam.asynchronous.graph import Graph, as_graph
from decentadam.asynchronous.pairing import (
    HEARTBEAT_SECONDS,
    MatchClient,
    Matchmaker,
    PairingWorker,
    PeerFailure,
    Schedule,
    gossip_store,
)
from decentadam.buckets import AveragedParameters
from decentadam.collectives import (
    CommStats,
    ExchangeGroupsReleased,
    SingleProcessCommunicator,
    WorldCollectives,
    WorldCommunicator,
)
from decentadam.topology import Topology

__all__ = [
    "A2CiD2",
    "ContinuizedConstants",
    "continuized_average_",
    "continuized_constants",
    "continuized_mix_",
    "gossip_store",
]

logger = logging.getLogger(__name__)

_ONE_BUCKET = 2**62  # bucket size: one flat buffer per (param group, device, dtype)
_FRACTION_CAP = 0.999  # the clock's estimate of the current step's elapsed part stays below 1


def _cpu_buffer(buffer: Tensor) -> Tensor:
    if buffer.device.type == "cpu":
        return buffer
    return torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)


class _StepClock:
    """Time in gradient steps: completed steps plus the estimated fraction of the current one."""

    def __init__(self) -> None:
        # (steps, monotonic time of the last step, mean seconds per step or None): one attribute,
        # replaced whole, so that the pairing thread reads a consistent triple without a lock
        self._state: tuple[int, float, float | None] = (0, time.monotonic(), None)

    @property
    def steps(self) -> int:
        return self._state[0]

    def now(self) -> float:
        steps, last, seconds = self._state
        if seconds is None:
            return float(steps)
        return steps + min((time.monotonic() - last) / seconds, _FRACTION_CAP)

    def seconds_until(self, target: float) -> float:
        steps, _, seconds = self._state
        if seconds is None or target >= steps + _FRACTION_CAP:
            return HEARTBEAT_SECONDS  # not before the next step, which wakes the pairing thread
        return max(0.0, (target - self.now()) * seconds)

    def tick(self) -> None:
        steps, last, seconds = self._state
        now = time.monotonic()
        if steps > 0:  # the first interval includes everything before training: not a step
            seconds = now - last if seconds is None else 0.8 * seconds + 0.2 * (now - last)
        self._state = (steps + 1, now, seconds)

    def reset(self, steps: int) -> None:
        self._state = (steps, time.monotonic(), self._state[2])


class A2CiD2(Optimizer):
    r"""Asynchronous gossip with continuized momentum around a local optimizer (module docstring).

    ::

        optimizer = A2CiD2(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), graph="ring")
        for x, y in loader:                          # this rank's data, at this rank's pace
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()                         # local step; averagings run in the background
        optimizer.close()                            # every rank leaves with the exact average

    It is a torch ``Optimizer`` sharing the local optimizer's ``param_groups`` and ``state``, so
    LR schedulers, ``zero_grad`` and Accelerate's wrapper work on it. Only the parameters that
    require gradients at construction are averaged; buffers (BatchNorm statistics) stay local
    (:func:`decentadam.consensus.averaged` averages them for evaluation).

    Args:
        optimizer: the local optimizer (any torch optimizer that communicates nothing).
        graph: ``"ring"``, ``"exp"``, ``"complete"`` (:mod:`decentadam.asynchronous.graph`), a
            :class:`~decentadam.asynchronous.graph.Graph`, or a :class:`~decentadam.Topology` (its
            groups' pairs).
        rate: averagings per gradient step of this rank, on average.
        process_group: the ranks that train together (default: the world).
        continuized: ``False``: no ``x~``, plain asynchronous pairwise averaging.
        schedule: ``"poisson"`` (exponential gaps between averagings) or ``"deterministic"``
            (gaps of exactly ``1 / rate``).
        seed: seed of the Poisson times (each rank draws from ``(seed, rank)``).
        timeout: seconds after which a silent rank is declared dead, and an exchange that has
            not completed fails.
        store: the key-value store of the pairing, the same on every rank (its keys go under a
            prefix of this instance). Default: a ``torch.distributed.TCPStore`` that the first rank
            of the group hosts on a free port (:func:`gossip_store`).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        graph: str | Graph | Topology = "ring",
        rate: float = 1.0,
        process_group: dist.ProcessGroup | None = None,
        *,
        continuized: bool = True,
        schedule: Literal["poisson", "deterministic"] = "poisson",
        seed: int = 0,
        timeout: float = 60.0,
        store: Store | None = None,
    ) -> None:
        # duck-typed: an optimizer with a communicator (DecentralizedAdam, A2CiD2) averages by itself
        if not isinstance(optimizer, Optimizer) or hasattr(optimizer, "communicator"):
            raise TypeError(
                "A2CiD2 wraps a local torch optimizer (e.g. torch.optim.SGD or decentadam.AccumAdamW), got "
                f"{type(optimizer).__name__}"
            )
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        Schedule(rate, schedule, seed)  # checks rate and schedule
        super().__init__(optimizer.param_groups, optimizer.defaults)  # the same group dicts
        self.optimizer = optimizer
        self.state = optimizer.state

        distributed.check_launch_environment()
        communicator: WorldCollectives
        if distributed.is_initialized() and dist.get_world_size(process_group) > 1:
            communicator = WorldCommunicator(process_group)
        else:
            communicator = SingleProcessCommunicator()
        self.communicator = communicator
        self.rank, self.world_size = communicator.rank, communicator.world_size
        self.graph = as_graph(graph, self.world_size)
        self.rate = rate
        self.continuized = continuized
        self.timeout = timeout
        self.constants = continuized_constants(self.graph, rate)
        self._eta = self.constants.eta if continuized else 0.0
        self._alpha_tilde = self.constants.alpha_tilde if continuized else 0.5
        self.stats = CommStats()

        self._buckets = bucketing.make_buckets(self.param_groups, _ONE_BUCKET)
        in_buckets = {id(p) for b in self._buckets for p in b.params}
        self._frozen = [p for g in self.param_groups for p in g["params"] if id(p) not in in_buckets]
        gossip = self.world_size > 1
        self._offsets = [torch.zeros_like(b.buffer) for b in self._buckets] if gossip and continuized else []
        self._offset_views = [
            bucketing.views_like(y, b.params) for y, b in zip(self._offsets, self._buckets, strict=False)
        ]
        # send buffers: the bucket's own buffer on CPU; pinned CPU memory for CUDA parameters (the
        # bucket's device buffer then stages the snapshot and the received delta)
        self._send = [_cpu_buffer(b.buffer) for b in self._buckets] if gossip else []
        self._recv = [torch.empty_like(s) for s in self._send]
        self._recv_views = [
            bucketing.views_like(r, b.params) for r, b in zip(self._recv, self._buckets, strict=False)
        ]

        self._lock = threading.Lock()  # orders this rank's events: gradient steps, averagings
        self._clock = _StepClock()
        self._time = 0.0  # the clock time up to which x and x~ are mixed
        self._closed = False
        self._error_reported = False
        self._open_average = False  # an average_parameters() whose local weights are not back yet
        self._group: dist.ProcessGroup | None = None
        self._store: Store | None = None  # the pairing's own store, when A2CiD2 created it
        self._global: list[int] = []  # global rank of each rank of the process group
        self._matchmaker: Matchmaker | None = None
        self._worker: PairingWorker | None = None
        self._pairing_seconds = 0.0  # the worker's, kept when close() lets the worker go
        if gossip:
            params = [group["params"] for group in self.param_groups]
            distributed.check_same_parameters(params, process_group)
            bucketing.broadcast(self._buckets, self._frozen, communicator)
            self._start_gossip(process_group, schedule, seed, store)
            shutdown.register(self)
        c = self.constants
        logger.info(
            "A2CiD2: rank %d of %d, graph %s (%d edges), %g averagings per step, continuized %s: "
            "chi1 %.4g, chi2 %.4g, eta %.4g, alpha~ %.4g",
            *(self.rank, self.world_size, self.graph.name, len(self.graph.edges), rate, continuized),
            *(c.chi1, c.chi2, c.eta, c.alpha_tilde),
        )

    def _start_gossip(
        self,
        process_group: dist.ProcessGroup | None,
        kind: Literal["poisson", "deterministic"],
        seed: int,
        store: Store | None,
    ) -> None:
        ranks = [self._global_rank(process_group, r) for r in range(self.world_size)]
        # Only the members create it (use_local_synchronization): a sub-group's A2CiD2 needs no
        # call from the other ranks. Its unique name, agreed by the members, prefixes the store keys.
        self._group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._global = ranks
        if store is None:
            store = self._store = gossip_store(self._group, ranks[0], self.timeout)
        store = PrefixStore(f"decentadam/a2cid2/{self._group.group_name}/", store)
        if self.rank == 0:
            self._matchmaker = Matchmaker(store, self.graph, self.timeout, seed)
            self._matchmaker.start()
        self._worker = PairingWorker(
            MatchClient(store, self.rank, self.timeout),
            self._exchange,
            self._clock,
            Schedule(self.rate, kind, seed * 1_000_003 + self.rank),
        )
        self._worker.start()

    @staticmethod
    def _global_rank(process_group: dist.ProcessGroup | None, rank: int) -> int:
        return rank if process_group is None else dist.get_global_rank(process_group, rank)

    # ------------------------------------------------------------------ the gradient event

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Mix ``x`` and ``x~`` up to this step, take the local optimizer's step; never waits for peers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_can_step()
        bucketing.check_no_gradients(self._frozen)
        start = time.perf_counter()
        with self._lock:
            waited = time.perf_counter() - start
            self._mix(float(self._clock.steps + 1))
            self.optimizer.step()
            self._clock.tick()
        self.stats.wait_seconds += waited
        self.stats.steps += 1
        if self._worker is not None:
            if self.stats.steps == 1:
                self._worker.enable()
            self._worker.wake()
        return loss

    def _check_can_step(self) -> None:
        if self._closed:
            raise ExchangeGroupsReleased("A2CiD2 was closed; build a new one to train again")
        if self._open_average:
            raise RuntimeError(
                "A2CiD2: step() while the parameters hold the average of an average_parameters() that was "
                "not restored; use `with optimizer.average_parameters(): ...` (or restore=False)"
            )
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        error = self._worker.error if self._worker is not None else None
        if error is None:
            return
        self._error_reported = True
        raise self._explain(error) from error

    def _explain(self, error: BaseException) -> PeerFailure:
        if isinstance(error, PeerFailure):
            return PeerFailure(f"rank {self.rank}: {error}")
        return PeerFailure(
            f"rank {self.rank}: the asynchronous gossip failed ({type(error).__name__}: {error}). If the "
            "key-value store is unreachable, rank 0 (which hosts it and the matchmaker) probably died."
        )

    def _mix(self, to_time: float) -> None:
        """Advance the continuized mixing of x and x~ up to ``to_time`` (holding the lock)."""
        dt = to_time - self._time
        if dt <= 0.0:
            return
        self._time = to_time
        if not self._offsets:  # continuized=False, or a single rank: x~ is not kept
            return
        for bucket, offsets in zip(self._buckets, self._offset_views, strict=True):
            continuized_mix_([p.data for p in bucket.params], offsets, self._eta, dt)

    # ------------------------------------------------------------------ the averaging event

    def _exchange(self, peer: int, exchange: int) -> None:
        """Average with ``peer`` (runs in the pairing thread; ``exchange`` numbers the pairing)."""
        assert self._group is not None
        with self._lock:
            self._mix(self._clock.now())
            for bucket, send in zip(self._buckets, self._send, strict=True):
                torch._foreach_copy_(bucket.views, [p.data for p in bucket.params])
                if send is not bucket.buffer:
                    send.copy_(bucket.buffer)
        tag = exchange % 2**31
        works = []
        for send, recv in zip(self._send, self._recv, strict=True):
            works.append(dist.isend(send, self._global[peer], group=self._group, tag=tag))
            works.append(dist.irecv(recv, self._global[peer], group=self._group, tag=tag))
        try:
            for work in works:
                assert work is not None
                work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise PeerFailure(
                f"the averaging of rank {self.rank} with rank {peer} failed (waiting at most "
                f"{self.timeout:g} s): rank {peer} probably died or stalled. Cause: {error}"
            ) from error
        for send, recv in zip(self._send, self._recv, strict=True):
            recv.sub_(send)  # d = x_peer - x_self, both as sent
        with self._lock:
            self._mix(self._clock.now())
            for i, bucket in enumerate(self._buckets):
                deltas = self._recv_views[i]
                if self._send[i] is not bucket.buffer:  # CUDA: bring d to the device
                    bucket.buffer.copy_(self._recv[i])
                    deltas = bucket.views
                offsets = self._offset_views[i] if self._offsets else []
                continuized_average_([p.data for p in bucket.params], offsets, deltas, self._alpha_tilde)
        self.stats.exchanges += 1
        self.stats.bytes_sent += sum(s.numel() * s.element_size() for s in self._send)

    # ------------------------------------------------------------------ pausing and consensus

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No averaging of this rank runs or starts inside the block (this rank's steps may go on).

        Once every rank is inside, no exchange is in flight anywhere: the sum of the parameters
        over ranks is exact. Raises if the gossip has failed (a collective would hang).
        """
        self._pause()
        try:
            yield
        finally:
            self._resume()

    def _pause(self) -> None:
        if self._worker is None or self._closed:
            return
        self._worker.pause()
        if self._worker.error is not None:
            self._worker.resume()
            self._raise_if_failed()

    def _resume(self) -> None:
        if self._worker is not None and not self._closed:
            self._worker.resume()

    def average_parameters(self, restore: bool = True) -> AveragedParameters:
        """Set every rank's parameters to the exact average over all ranks (a collective).

        ``with opt.average_parameters(): evaluate(model)`` evaluates the consensus model with the
        averagings paused, and puts each rank's own parameters back on exit; ``restore=False`` keeps
        the average. ``x~`` is left as it is (its offset ``y`` to ``x`` stays local).
        """
        if not restore:
            with self.paused():
                return bucketing.average(self._buckets, self.communicator, restore=False)
        self._pause()
        try:
            averaged = bucketing.average(self._buckets, self.communicator, True, self._after_average)
        except BaseException:
            self._resume()
            raise
        self._open_average = True  # until the local parameters are back: step() refuses meanwhile
        return averaged

    def _after_average(self) -> None:
        self._open_average = False
        self._resume()

    def consensus_stats(self) -> tuple[float, float]:
        """(mean_i ||x_i - x_bar||^2, ||x_bar||^2), float64, with the averagings paused (a collective)."""
        with self.paused():
            return bucketing.consensus_stats(self._buckets, self.communicator, self.device)

    def consensus_distance(self, relative: bool = False) -> float:
        """mean_i ||x_i - x_bar||^2 (``relative``: divided by ||x_bar||^2); a collective."""
        distance, mean_norm = self.consensus_stats()
        if not relative:
            return distance
        return distance / mean_norm if mean_norm > 0 else 0.0

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop averaging, wait until every rank has stopped, then set all ranks to the exact average.

        Call it on every rank when training ends (a collective), before
        ``dist.destroy_process_group()`` or ``accelerator.end_training()``; a fast rank waits here for
        the slower ones to finish. ``with A2CiD2(...) as optimizer:`` calls it on exit. Idempotent.
        Raises :class:`~decentadam.asynchronous.pairing.PeerFailure` if a rank died (unless a step already
        reported it): then there is no final average.
        """
        if self._closed:
            return
        self._closed = True
        shutdown.unregister(self)
        if self._worker is None:
            return
        try:
            self._worker.stop()  # leave the pairing; returns once every rank has left
        except BaseException as error:
            if self._matchmaker is not None:
                self._matchmaker.stop()
            if self._error_reported:
                logger.warning("decentadam: A2CiD2 closed after a failure, no final average: %s", error)
                return
            self._error_reported = True
            raise self._explain(error) from error
        if self._matchmaker is not None:
            self._matchmaker.join()
        bucketing.average(self._buckets, self.communicator, restore=False)  # nothing is in flight now
        # Every rank is past the pairing: drop each reference to the store (the worker's client and
        # the matchmaker hold it too), so that rank 0 stops serving it and its sockets close now,
        # not when the closed optimizer is garbage-collected.
        self._pairing_seconds = self._worker.pairing_seconds
        self._store, self._worker, self._matchmaker = None, None, None
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError) as error:  # destroyed by the user already
                logger.debug("decentadam: could not destroy the A2CiD2 exchange group: %s", error)

    def __enter__(self) -> A2CiD2:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    @property
    def step_count(self) -> int:
        """Gradient steps taken by this rank (ranks differ: each goes at its own pace)."""
        return self._clock.steps

    @property
    def averagings(self) -> int:
        """Averagings this rank took part in."""
        return self.stats.exchanges

    @property
    def pairing_seconds(self) -> float:
        """Time this rank's pairing thread spent ready, waiting for a partner."""
        return self._worker.pairing_seconds if self._worker is not None else self._pairing_seconds

    @property
    def device(self) -> torch.device:
        return self._buckets[0].buffer.device if self._buckets else torch.device("cpu")

    @property
    def run_name(self) -> str:
        """How checkpoints name this run's communication (``a2cid2-<graph>``)."""
        return f"a2cid2-{self.graph.name}"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while the optimizer is built: the averaged buffers are fixed at construction."""
        if hasattr(self, "_buckets"):
            raise RuntimeError(
                "A2CiD2: add_param_group() after construction is not supported; add the group to the "
                "local optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state, plus ``a2cid2``: the step count and ``y = x~ - x`` per buffer."""
        state = self.optimizer.state_dict()
        with self._lock:
            state["a2cid2"] = {
                "steps": self._clock.steps,
                "x_tilde_minus_x": [y.detach().clone() for y in self._offsets],
                "graph": self.graph.name,
                "world_size": self.world_size,
                "rate": self.rate,
                "continuized": self.continuized,
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's state (the local optimizer's, the step count and ``x~ - x``)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("a2cid2", None)
        with self._lock:
            self.optimizer.load_state_dict(state_dict)
            self.param_groups = self.optimizer.param_groups  # load_state_dict built new group dicts
            self.state = self.optimizer.state
            if extra is None:
                return
            saved = (extra["graph"], extra["world_size"])
            if saved != (self.graph.name, self.world_size):
                logger.warning(
                    "A2CiD2 state was saved with graph %s on %d ranks; continuing with %s on %d",
                    *saved,
                    *(self.graph.name, self.world_size),
                )
            offsets = extra["x_tilde_minus_x"]
            if len(offsets) == len(self._offsets):
                for y, value in zip(self._offsets, offsets, strict=True):
                    y.copy_(value)
            self._clock.reset(int(extra["steps"]))
            self._time = float(self._clock.steps)
