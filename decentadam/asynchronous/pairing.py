"""Pairing for asynchronous gossip: which two ranks average together next, and when.

Each rank runs a :class:`PairingWorker` thread. On its own schedule (``rate`` averagings per
gradient step of its own, at Poisson or evenly spaced times) the worker declares itself *ready*;
a :class:`Matchmaker`, one thread on rank 0, pairs it with one of its ready neighbours (on a
:class:`~decentadam.asynchronous.graph.Graph`) drawn uniformly at random, or keeps it waiting until
one is ready; both workers then run the exchange and go back to their schedules. The uniform draw
is what the A2CiD2 constants assume (:meth:`~decentadam.asynchronous.graph.Graph.laplacian`): on a
regular graph whose ranks run alike, every edge is then used equally often.

Mechanism: a matchmaker over a key-value store (a ``torch.distributed.TCPStore`` hosted by rank 0,
:func:`decentadam.asynchronous.a2cid2.gossip_store`), chosen over two alternatives:

- conflict-free matchings agreed in advance (a :class:`~decentadam.topology.Topology`'s rounds)
  pair ranks in a fixed order, so an exchange waits for one particular peer: a straggler holds up
  each of its neighbours once per round, the synchronisation asynchrony is meant to remove. The
  matchmaker pairs whoever is ready now;
- a decentralized handshake (each rank locking itself, then a neighbour, with ``compare_set``)
  needs no central thread, but two ranks that lock themselves at once must back off and retry
  (livelock on symmetric timing), and a rank killed between its two locks leaves a neighbour locked.
  One matchmaker reading one queue in order makes each decision atomic and easy to check.

The store works beside any backend (also NCCL), is reachable from any thread without a process
group, and its single-key ``add``/``set``/``check`` are atomic. Its cost is a few store round trips
per averaging (about 10 us each on loopback), and rank 0 hosting both the store and the matchmaker.
Waits poll with ``check`` and a short back-off (0.2-5 ms): a blocking ``wait`` would hold the
store client's lock (other threads of the process use the same client) and logs a warning at every
timeout.

Protocol (keys under a per-instance prefix):

=================  ================================================================================
``q/len``          counter of messages posted (``add``)
``q/<k>``          the ``k``-th message, ``"<rank> <kind> <n>"``, kind ``ready``, ``cancel`` or ``leave``
``a/<rank>/<n>``   the answer to the rank's ``n``-th ``ready``: ``"pair <peer> <exchange>"``,
                   ``"cancelled"`` or ``"alone"`` (every neighbour has left)
``hb/<rank>``      heartbeat counter, incremented by the rank's worker every 0.5 s
``dead``           why the gossip stopped: set by the matchmaker when a rank's heartbeat stopped for
                   ``timeout`` seconds, or when the matchmaker itself failed
``done``           set by the matchmaker once every rank has left
=================  ================================================================================

Invariants (checked by tests/test_pairing.py with many short randomized runs):

- a rank is in at most one exchange: it posts ``ready`` only when its previous request was
  answered and that exchange finished, and the matchmaker answers each request exactly once;
- two ranks pair only when both are ready: the matchmaker pairs two pending requests;
- no deadlock: an exchange involves only its two ranks, both committed; a pending request is
  answered when a neighbour becomes ready, when its rank cancels it (to pause or close), or with
  ``alone`` once all its neighbours have left; closing waits for ``done`` and for nothing else;
- a dead rank makes the others fail within ``timeout``: its heartbeat stops, the matchmaker sets
  ``dead`` (or sooner: a worker whose exchange failed sets it, naming its partner), and every
  worker checks that key at each heartbeat. If rank 0 dies, the store goes with it and every other
  worker's next store operation fails.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in torch's __all__
from torch.distributed.distributed_c10d import Store

from decentadam.asynchronous.graph import Graph

__all__ = [
    "HEARTBEAT_SECONDS",
    "Clock",
    "MatchClient",
    "Matchmaker",
    "PairingWorker",
    "PeerFailure",
    "Schedule",
    "gossip_store",
]

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.5
"""How often a worker proves it is alive (and checks whether another rank was declared dead)."""

_POLL_MIN, _POLL_MAX = 2e-4, 5e-3  # seconds: back-off of the store polls


def gossip_store(group: dist.ProcessGroup, host_rank: int, timeout: float) -> TCPStore:
    """A ``torch.distributed.TCPStore`` for the pairing of ``group``, hosted by global rank ``host_rank``.

    A collective over ``group``: the host listens on a free port and broadcasts its address, the
    others connect. The address is ``MASTER_ADDR`` when the host is global rank 0 (the address every
    rank already reaches), the host's name otherwise; pass ``store=`` to
    :class:`~decentadam.asynchronous.a2cid2.A2CiD2` where neither is reachable.
    """
    wait = timedelta(seconds=timeout)
    store = None
    address: list[Any] = [None, 0]
    if dist.get_rank() == host_rank:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if host_rank == 0 else socket.getfqdn()
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=wait)
        address = [host, store.port]
    dist.broadcast_object_list(address, src=host_rank, group=group)
    if store is None:
        store = TCPStore(address[0], address[1], is_master=False, timeout=wait)
    return store


class PeerFailure(RuntimeError):
    """A rank of the asynchronous gossip died or stalled, or the store (on rank 0) is unreachable."""


class _Backoff:
    """Sleeps that grow from 0.2 ms to ``cap`` seconds; ``reset()`` after progress."""

    def __init__(self, cap: float = _POLL_MAX) -> None:
        self.cap = cap
        self.delay = _POLL_MIN

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def reset(self) -> None:
        self.delay = _POLL_MIN


def _neighbours_left(graph: Graph, rank: int, left: set[int]) -> bool:
    return all(other in left for other in graph.neighbours(rank))


class Matchmaker:
    """Pairs a ready rank with a ready neighbour drawn uniformly; runs in a thread on one rank.

    Reads the message queue in order, so every decision sees the effect of the previous ones.
    Watches the heartbeats of the ranks that have not left; a rank silent for ``timeout`` seconds
    is declared dead (``dead`` key) and the matchmaker stops. Stops by itself once every rank left.
    """

    def __init__(self, store: Store, graph: Graph, timeout: float, seed: int = 0) -> None:
        self.store = store
        self.graph = graph
        self.timeout = timeout
        self._random = random.Random(seed)
        self.error: BaseException | None = None
        self.exchanges = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decentadam-matchmaker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (for an abandoned run: the workers then see no more answers)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as error:
            self.error = error
            logger.error("decentadam: the A2CiD2 matchmaker failed: %s", error)
            with contextlib.suppress(Exception):  # tell the workers, if the store still answers
                self.store.set("dead", f"the matchmaker on rank 0 failed ({error})")

    def _serve(self) -> None:
        store, graph = self.store, self.graph
        pending: dict[int, int] = {}  # rank -> request number
        left: set[int] = set()
        now = time.monotonic()
        beats = {rank: (-1, now) for rank in range(graph.world_size)}  # last value, when it changed
        checked = now
        backoff = _Backoff()
        index = 1
        while not self._stop.is_set():
            key = f"q/{index}"
            if store.check([key]):
                text = store.get(key).decode()
                store.delete_key(key)
                index += 1
                backoff.reset()
                word_rank, kind, word_number = text.split()
                rank, number = int(word_rank), int(word_number)
                if kind == "ready":
                    ready = [p for p in graph.neighbours(rank) if p in pending]
                    if ready:
                        partner = self._random.choice(ready)
                        self.exchanges += 1
                        store.set(f"a/{partner}/{pending.pop(partner)}", f"pair {rank} {self.exchanges}")
                        store.set(f"a/{rank}/{number}", f"pair {partner} {self.exchanges}")
                    elif _neighbours_left(graph, rank, left):
                        store.set(f"a/{rank}/{number}", "alone")
                    else:
                        pending[rank] = number
                elif kind == "cancel":
                    if pending.get(rank) == number:
                        del pending[rank]
                        store.set(f"a/{rank}/{number}", "cancelled")
                elif kind == "leave":
                    left.add(rank)
                    pending.pop(rank, None)
                    for other in [p for p in pending if _neighbours_left(graph, p, left)]:
                        store.set(f"a/{other}/{pending.pop(other)}", "alone")
                    if len(left) == graph.world_size:
                        store.set("done", "1")
                        return
                else:
                    raise ValueError(f"unknown pairing message {text!r}")
            else:
                backoff.sleep()
            now = time.monotonic()
            if now - checked < HEARTBEAT_SECONDS:
                continue
            checked = now
            if store.check(["dead"]):  # a worker reported its own failure
                return
            for rank in range(graph.world_size):
                value = int(store.add(f"hb/{rank}", 0))
                if value != beats[rank][0]:
                    beats[rank] = (value, now)
            silent = [
                r for r in range(graph.world_size) if r not in left and now - beats[r][1] > self.timeout
            ]
            if silent:
                rank = min(silent, key=lambda r: beats[r][1])  # the one silent for longest
                reason = (
                    f"rank {rank} sent no heartbeat for {self.timeout:g} s: it probably died or hangs "
                    "(check its log)"
                )
                logger.error("decentadam: %s", reason)
                store.set("dead", reason)
                return


@dataclass(frozen=True)
class Answer:
    """The matchmaker's answer to one ``ready``."""

    kind: Literal["pair", "cancelled", "alone"]
    peer: int = -1
    exchange: int = 0


class MatchClient:
    """One rank's side of the protocol (module docstring); used by its worker thread only."""

    def __init__(self, store: Store, rank: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.timeout = timeout
        self._requests = 0
        self._last_beat = -math.inf

    def _post(self, kind: str, number: int) -> None:
        index = self.store.add("q/len", 1)
        self.store.set(f"q/{index}", f"{self.rank} {kind} {number}")

    def request(self) -> int:
        """Post ``ready``; returns the request's number, to :meth:`answer` or :meth:`cancel` it."""
        self._requests += 1
        self._post("ready", self._requests)
        return self._requests

    def cancel(self, number: int) -> None:
        """Withdraw request ``number``: it is answered ``cancelled``, unless already paired."""
        self._post("cancel", number)

    def leave(self) -> None:
        """No more requests from this rank."""
        self._post("leave", 0)

    def answer(self, number: int) -> Answer | None:
        """The answer to request ``number``, or None if there is none yet."""
        key = f"a/{self.rank}/{number}"
        if not self.store.check([key]):
            return None
        words = self.store.get(key).decode().split()
        self.store.delete_key(key)
        if words[0] == "pair":
            return Answer("pair", int(words[1]), int(words[2]))
        kind: Literal["cancelled", "alone"] = "cancelled" if words[0] == "cancelled" else "alone"
        return Answer(kind)

    def report(self, error: BaseException) -> None:
        """Tell every rank why this rank's gossip stopped, unless a failure was reported already.

        A rank whose exchange failed (its partner died) stops heartbeating; without this the
        others would name it, not the dead partner, once its heartbeat is missed.
        """
        with contextlib.suppress(Exception):  # the store may be what failed
            if not self.store.check(["dead"]):
                self.store.set("dead", f"rank {self.rank} stopped: {error}")

    def finished(self) -> bool:
        """Whether every rank has left."""
        return bool(self.store.check(["done"]))

    def beat_due(self) -> bool:
        return time.monotonic() - self._last_beat >= HEARTBEAT_SECONDS

    def beat(self) -> None:
        """Every 0.5 s: prove this rank alive; raise PeerFailure if another rank was declared dead."""
        if not self.beat_due():
            return
        self._last_beat = time.monotonic()
        self.store.add(f"hb/{self.rank}", 1)
        if self.store.check(["dead"]):
            raise PeerFailure(f"the asynchronous gossip stopped: {self.store.get('dead').decode()}")


class Clock(Protocol):
    """Time in units of this rank's own gradient steps."""

    def now(self) -> float:
        """The current time (completed steps plus the elapsed part of the current one)."""
        ...

    def seconds_until(self, time: float) -> float:
        """A guess of the wall-clock seconds until :meth:`now` reaches ``time`` (for sleeping)."""
        ...


class Schedule:
    """When a rank wants to average: ``rate`` times per unit of its clock, at Poisson or even times.

    ``poisson``: exponential gaps of mean ``1 / rate`` (the continuized model); ``deterministic``:
    gaps of exactly ``1 / rate`` (tests). A rank that could not pair for a while catches up at
    most ``max(1, rate)`` averagings, not all it missed.
    """

    def __init__(self, rate: float, kind: Literal["poisson", "deterministic"], seed: int) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 averagings per gradient step, got {rate}")
        if kind not in ("poisson", "deterministic"):
            raise ValueError(f"schedule must be 'poisson' or 'deterministic', got {kind!r}")
        self.rate = rate
        self.kind = kind
        self._random = random.Random(seed)

    def gap(self) -> float:
        return self._random.expovariate(self.rate) if self.kind == "poisson" else 1.0 / self.rate

    def next_due(self, due: float, now: float) -> float:
        return max(due + self.gap(), now - max(1.0, self.rate) / self.rate)


class PairingWorker:
    """One rank's background thread: ready on its schedule, paired by the matchmaker, exchange.

    ``exchange(peer, exchange_id)`` runs in this thread and must return once the averaging with
    ``peer`` is applied (or raise). The worker heartbeats from :meth:`start` on, but asks for
    partners only after :meth:`enable`. :meth:`pause` returns once no exchange is in flight or
    requested, and none starts until :meth:`resume`. :meth:`stop` leaves the pairing and returns
    once every rank has left (or raises what the thread met: a dead peer, a failed exchange).
    """

    def __init__(
        self,
        client: MatchClient,
        exchange: Callable[[int, int], None],
        clock: Clock,
        schedule: Schedule,
    ) -> None:
        self.client = client
        self.clock = clock
        self.schedule = schedule
        self.error: BaseException | None = None
        self.averagings = 0
        self.pairing_seconds = 0.0  # time spent ready, waiting for a partner
        self.alone = False  # every neighbour has left: no more averagings
        self._exchange = exchange
        self._cond = threading.Condition()
        self._enabled = False
        self._paused = 0
        self._stopping = False
        self._busy = False  # a request is posted or an exchange runs
        self._thread = threading.Thread(target=self._run, name="decentadam-gossip", daemon=True)

    # ------------------------------------------------------------------ control (other threads)

    def start(self) -> None:
        self._thread.start()

    def enable(self) -> None:
        """Start asking for partners (A2CiD2 does it at its first gradient step)."""
        with self._cond:
            self._enabled = True
            self._cond.notify_all()

    def wake(self) -> None:
        """The clock moved (a gradient step): re-check whether an averaging is due."""
        with self._cond:
            self._cond.notify_all()

    def pause(self) -> None:
        """Return once no exchange is requested or running; none starts until :meth:`resume`."""
        with self._cond:
            self._paused += 1
            self._cond.notify_all()
            while self._busy and self.error is None:
                self._cond.wait(0.1)

    def resume(self) -> None:
        with self._cond:
            self._paused -= 1
            self._cond.notify_all()

    def stop(self) -> None:
        """Leave the pairing; return once every rank has left. Raises the thread's error, if any."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        while self._thread.is_alive():
            self._thread.join(0.5)
        if self.error is not None:
            raise self.error

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._loop()
            self.client.leave()
            backoff = _Backoff(cap=0.05)
            while not self.client.finished():
                self.client.beat()
                backoff.sleep()
        except BaseException as error:  # re-raised by stop(), and by A2CiD2.step()
            self.error = error
            self.client.report(error)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _loop(self) -> None:
        due = self.schedule.gap()
        while True:
            with self._cond:
                while not self._stopping:
                    idle = self.alone or not self._enabled or self._paused
                    if not idle and self.clock.now() >= due:
                        self._busy = True
                        break
                    wait = HEARTBEAT_SECONDS if idle else self.clock.seconds_until(due)
                    self._cond.wait(min(max(wait, 1e-3), HEARTBEAT_SECONDS))
                    if self.client.beat_due():
                        break  # heartbeat outside the lock, then come back
                if self._stopping:
                    return
                busy = self._busy
            if not busy:
                self.client.beat()
                continue
            try:
                answer = self._await_partner()
                if answer.kind == "pair":
                    self._exchange(answer.peer, answer.exchange)
                    self.averagings += 1
                    due = self.schedule.next_due(due, self.clock.now())
                elif answer.kind == "alone":
                    self.alone = True
                    logger.info("decentadam: rank %d has no neighbour left to average with", self.client.rank)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _await_partner(self) -> Answer:
        start = time.monotonic()
        number = self.client.request()
        cancelled = False
        backoff = _Backoff()
        while True:
            answer = self.client.answer(number)
            if answer is not None:
                self.pairing_seconds += time.monotonic() - start
                return answer
            if not cancelled and (self._paused or self._stopping):
                self.client.cancel(number)
                cancelled = True
            self.client.beat()
            backoff.sleep()
