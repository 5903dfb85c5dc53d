"""The pairing protocol of asynchronous gossip, in one process: threads as ranks, an in-memory store.

Each rank runs the real :class:`PairingWorker` and rank 0's :class:`Matchmaker` serves them over a
``torch.distributed.HashStore``; the exchange is a fake that checks the invariants and makes both
partners meet (a two-party barrier, as the real point-to-point swap does).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch.distributed as dist

from decentadam.asynchronous.graph import Graph, build_graph
from decentadam.asynchronous.pairing import MatchClient, Matchmaker, PairingWorker, PeerFailure, Schedule


class FakeClock:
    """Steps advanced by the test's 'training' thread; the fraction of a step is ignored."""

    def __init__(self) -> None:
        self.steps = 0

    def now(self) -> float:
        return float(self.steps)

    def seconds_until(self, target: float) -> float:
        return 0.001


class Monitor:
    """Records exchanges and fails on any rank found in two at once or a pair that does not meet."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.lock = threading.Lock()
        self.active: dict[int, int] = {}  # rank -> exchange id
        self.barriers: dict[int, threading.Barrier] = {}
        self.members: dict[int, set[tuple[int, int]]] = {}  # exchange id -> {(rank, peer)}
        self.errors: list[str] = []

    def exchange(self, rank: int, peer: int, exchange: int, delay: float) -> None:
        with self.lock:
            if rank in self.active:
                self.errors.append(f"rank {rank} in exchanges {self.active[rank]} and {exchange} at once")
            if peer not in self.graph.neighbours(rank):
                self.errors.append(f"rank {rank} paired with {peer}, not a neighbour")
            self.active[rank] = exchange
            self.members.setdefault(exchange, set()).add((rank, peer))
            barrier = self.barriers.setdefault(exchange, threading.Barrier(2))
        barrier.wait(timeout=10)  # the partner must come: BrokenBarrierError fails the worker
        time.sleep(delay)
        with self.lock:
            del self.active[rank]


def run_once(graph: Graph, seed: int, prefix: str, store: dist.Store) -> tuple[Monitor, list[PairingWorker]]:
    rng = random.Random(seed)
    scoped = dist.PrefixStore(prefix, store)
    matchmaker = Matchmaker(scoped, graph, timeout=30.0)
    matchmaker.start()
    monitor = Monitor(graph)
    clocks = [FakeClock() for _ in range(graph.world_size)]
    workers = []
    for rank in range(graph.world_size):
        delays = random.Random(seed * 100 + rank)

        def exchange(peer: int, number: int, rank: int = rank, delays: random.Random = delays) -> None:
            monitor.exchange(rank, peer, number, delays.uniform(0, 0.002))

        kind = "poisson" if rng.random() < 0.5 else "deterministic"
        schedule = Schedule(rng.choice([0.5, 1.0, 3.0]), kind, seed * 100 + rank)
        workers.append(PairingWorker(MatchClient(scoped, rank, 30.0), exchange, clocks[rank], schedule))
    for worker in workers:
        worker.start()

    def train(rank: int) -> None:  # random step times, random pauses, a random length
        local = random.Random(seed * 1000 + rank)
        worker = workers[rank]
        if local.random() < 0.8:
            worker.enable()
        for _ in range(local.randint(0, 40)):
            time.sleep(local.uniform(0, 0.004))
            clocks[rank].steps += 1
            worker.wake()
            if local.random() < 0.1:
                worker.pause()
                with monitor.lock:
                    if rank in monitor.active:
                        monitor.errors.append(f"rank {rank} paused during an exchange")
                time.sleep(local.uniform(0, 0.002))
                worker.resume()
        worker.stop()

    threads = [threading.Thread(target=train, args=(rank,)) for rank in range(graph.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(t.is_alive() for t in threads), f"run {seed} ({graph.name}, n={graph.world_size}) hung"
    matchmaker.join(timeout=5)
    assert not matchmaker.is_alive() and matchmaker.error is None
    return monitor, workers


def test_pairing_never_double_books_a_rank_and_never_deadlocks() -> None:
    store = dist.HashStore()
    total = 0
    for seed in range(40):
        rng = random.Random(seed)
        graph = build_graph(rng.choice(["ring", "exp", "complete"]), rng.randint(2, 8))
        monitor, workers = run_once(graph, seed, f"run{seed}/", store)
        assert monitor.errors == [], (seed, monitor.errors)
        for worker in workers:
            assert worker.error is None, (seed, worker.error)
        for number, members in monitor.members.items():  # each pairing: two ranks naming each other
            (a, b), (c, d) = sorted(members)
            assert (a, b) == (d, c), (seed, number, members)
        assert sum(w.averagings for w in workers) == 2 * len(monitor.members)
        total += len(monitor.members)
    assert total > 500  # the runs did exchange


def test_a_silent_rank_is_declared_dead_and_the_others_fail() -> None:
    graph = build_graph("ring", 4)
    store = dist.PrefixStore("dead/", dist.HashStore())
    matchmaker = Matchmaker(store, graph, timeout=1.0)
    matchmaker.start()
    clock = FakeClock()
    workers = {
        rank: PairingWorker(
            MatchClient(store, rank, 1.0), lambda peer, number: None, clock, Schedule(1.0, "poisson", 0)
        )
        for rank in (0, 1, 3)  # rank 2 never starts: it sends no heartbeat
    }
    start = time.monotonic()
    for worker in workers.values():
        worker.start()
        worker.enable()
    for _ in range(200):
        clock.steps += 1
        time.sleep(0.01)
    for worker in workers.values():
        with pytest.raises(PeerFailure, match="rank 2 sent no heartbeat for 1 s"):
            worker.stop()
    assert time.monotonic() - start < 6


def test_schedule_rates() -> None:
    poisson = Schedule(2.0, "poisson", 0)
    gaps = [poisson.gap() for _ in range(20_000)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.03)
    assert Schedule(4.0, "deterministic", 0).gap() == 0.25
    # catching up: at most max(1, rate) averagings owed
    assert Schedule(1.0, "deterministic", 0).next_due(0.0, 10.0) == 9.0
    with pytest.raises(ValueError, match="rate must be > 0"):
        Schedule(0.0, "poisson", 0)


def test_the_matchmaker_draws_the_partner_uniformly_among_ready_neighbours() -> None:
    """Ranks 1 and 3 (rank 2's neighbours on a ring of 4) wait, 1 first; rank 2 gets ready. The
    A2CiD2 constants assume a uniform choice: both must be drawn, about equally often (a
    longest-waiting rule would always pick 1)."""
    graph = build_graph("ring", 4)
    store = dist.PrefixStore("uniform/", dist.HashStore())
    matchmaker = Matchmaker(store, graph, timeout=30.0, seed=1)
    matchmaker.start()
    clients = {rank: MatchClient(store, rank, 30.0) for rank in range(4)}

    def answer(rank: int, number: int) -> str:
        deadline = time.monotonic() + 10
        while (reply := clients[rank].answer(number)) is None:
            assert time.monotonic() < deadline, f"no answer to rank {rank}'s request {number}"
            time.sleep(1e-4)
        return reply.kind if reply.kind != "pair" else f"pair {reply.peer}"

    partners = []
    for _ in range(200):
        first, second = clients[1].request(), clients[3].request()
        mine = clients[2].request()
        partner = int(answer(2, mine).split()[1])
        partners.append(partner)
        waiting, number = (3, second) if partner == 1 else (1, first)
        assert answer(partner, first if partner == 1 else second) == "pair 2"
        clients[waiting].cancel(number)
        assert answer(waiting, number) == "cancelled"
    for client in clients.values():
        client.leave()
    matchmaker.join(10)
    assert matchmaker.error is None
    assert sorted(set(partners)) == [1, 3]
    assert 70 <= partners.count(1) <= 130  # binomial(200, 1/2): 4.2 standard deviations either side
