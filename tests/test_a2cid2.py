"""A2CiD2: the constants and the continuized mixing against docs/a2cid2.md, The algorithm, and real
asynchronous runs on 4 gloo processes (convergence, shutdown, a straggler, a killed rank)."""

from __future__ import annotations

import copy
import math
import os
import re
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from decentadam import A2CiD2, AccumAdamW, DecentralizedAdam, Setting, shutdown
from decentadam.asynchronous.a2cid2 import continuized_average_, continuized_constants, continuized_mix_
from decentadam.asynchronous.graph import Graph, as_graph, build_graph
from decentadam.asynchronous.pairing import PeerFailure
from decentadam.topology import build
from tests.distributed_harness import run_distributed

# ---------------------------------------------------------------------------- the math


@pytest.mark.parametrize(
    ("name", "eta", "alpha_tilde"),
    [("ring", 0.1425, 1.872), ("exp", 0.3863, 0.6761)],  # docs/a2cid2.md (the paper's values), n = 16, rate 1
)
def test_constants_match_algorithms_md(name: str, eta: float, alpha_tilde: float) -> None:
    constants = continuized_constants(build_graph(name, 16), rate=1.0)
    assert constants.eta == pytest.approx(eta, abs=5e-5)
    assert constants.alpha_tilde == pytest.approx(alpha_tilde, abs=5e-4)
    assert constants.eta == pytest.approx(1 / (2 * math.sqrt(constants.chi1 * constants.chi2)))


def test_exp_graph_counts_the_opposite_neighbour_once() -> None:
    graph = build_graph("exp", 16)
    assert graph.neighbours(0) == (1, 2, 4, 8, 12, 14, 15)
    assert all(graph.degree(rank) == 7 for rank in range(16))


def test_constants_scale_with_the_rate_and_come_from_topologies() -> None:
    ring = build_graph("ring", 8)
    once, twice = continuized_constants(ring, 1.0), continuized_constants(ring, 2.0)
    assert twice.eta == pytest.approx(2 * once.eta)  # L doubles: chi1, chi2 halve
    assert twice.alpha_tilde == pytest.approx(once.alpha_tilde)
    assert as_graph(build("ring", 8), 8).edges == ring.edges  # the ring topology's pairs: the cycle
    with pytest.raises(ValueError, match="not connected"):
        continuized_constants(Graph("two-pairs", 4, ((0, 1), (2, 3))), 1.0)
    assert continuized_constants(build_graph("ring", 1), 1.0).eta == 0.0


def test_one_ode_step_conserves_the_sum_and_contracts_the_difference() -> None:
    generator = torch.Generator().manual_seed(0)
    x = [torch.randn(5, 3, generator=generator, dtype=torch.float64) for _ in range(2)]
    x_tilde = [torch.randn(5, 3, generator=generator, dtype=torch.float64) for _ in range(2)]
    eta, dt = 0.3863, 0.7
    y = [b - a for a, b in zip(x, x_tilde, strict=True)]
    mixed = [a.clone() for a in x]
    continuized_mix_(mixed, y, eta, dt)
    mixed_tilde = [a + b for a, b in zip(mixed, y, strict=True)]
    matrix = torch.linalg.matrix_exp(torch.tensor([[-eta, eta], [eta, -eta]], dtype=torch.float64) * dt)
    for before, before_tilde, after, after_tilde in zip(x, x_tilde, mixed, mixed_tilde, strict=True):
        torch.testing.assert_close(after + after_tilde, before + before_tilde, rtol=0, atol=1e-14)
        torch.testing.assert_close(after - after_tilde, math.exp(-2 * eta * dt) * (before - before_tilde))
        torch.testing.assert_close(after, matrix[0, 0] * before + matrix[0, 1] * before_tilde)


def test_an_averaging_conserves_the_pair_and_follows_the_update() -> None:
    generator = torch.Generator().manual_seed(1)
    x_i, x_j, y_i, y_j = (torch.randn(7, generator=generator, dtype=torch.float64) for _ in range(4))
    alpha = 1.872
    new = [t.clone() for t in (x_i, x_j, y_i, y_j)]
    continuized_average_([new[0]], [new[2]], [x_j - x_i], alpha)
    continuized_average_([new[1]], [new[3]], [x_i - x_j], alpha)
    torch.testing.assert_close(new[0], (x_i + x_j) / 2)
    torch.testing.assert_close(new[0] + new[2], x_i + y_i + alpha * (x_j - x_i))  # x~_i += alpha~ (x_j - x_i)
    torch.testing.assert_close(new[0] + new[2] + new[1] + new[3], x_i + y_i + x_j + y_j)  # sum of x~


def test_single_process_is_the_local_optimizer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    optimizer = A2CiD2(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), graph="ring")
    local = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    for step in range(8):
        inputs = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, optimizer), (reference, local)):
            opt.zero_grad()
            m(inputs).square().mean().backward()
            opt.step()
        scheduler.step()
        for group in local.param_groups:
            group["lr"] = optimizer.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert optimizer.step_count == 8 and optimizer.param_groups[0]["lr"] == 0.1 * 0.5**2
    state = optimizer.state_dict()
    assert state["a2cid2"]["steps"] == 8
    optimizer.load_state_dict(state)
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    optimizer.close()


def test_bad_arguments_name_the_problem() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError, match="wraps a local torch optimizer"):
        A2CiD2(DecentralizedAdam(params, setting=Setting(topology="ring")))
    with pytest.raises(ValueError, match="rate must be > 0"):
        A2CiD2(AccumAdamW(params), rate=0.0)
    with pytest.raises(ValueError, match="schedule must be"):
        A2CiD2(AccumAdamW(params), schedule="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown graph"):
        A2CiD2(AccumAdamW(params), graph="torus")


# ---------------------------------------------------------------------------- 4 processes

DIM, SAMPLES, STEPS, LR = 12, 512, 300, 0.05
MIN_AVERAGINGS = 60  # a fifth of STEPS


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, DIM, generator=generator, dtype=torch.float64)
    truth = torch.randn(DIM, 1, generator=generator, dtype=torch.float64)
    targets = inputs @ truth + 0.1 * torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)
    return inputs, targets


def allreduce_sgd() -> torch.Tensor:
    """All-Reduce SGD on the same shards: the mean of the ranks' gradients is the full-data gradient."""
    inputs, targets = regression_data()
    weight = torch.zeros(DIM, 1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=LR, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        (0.5 * (inputs @ weight - targets).square().mean()).backward()
        optimizer.step()
    return weight.detach()


def threads_of_a2cid2() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("decentadam-gossip", "decentadam-matchmaker")]


def convergence_worker(rank: int, world_size: int, continuized: bool) -> dict[str, Any]:
    inputs, targets = regression_data()
    shard = slice(rank * SAMPLES // world_size, (rank + 1) * SAMPLES // world_size)
    inputs, targets = inputs[shard], targets[shard]  # each rank its own samples
    weight = nn.Parameter(torch.full((DIM, 1), float(rank), dtype=torch.float64))  # rank 0's wins
    optimizer = A2CiD2(
        torch.optim.SGD([weight], lr=LR, momentum=0.9),
        graph="ring",
        rate=1.0,
        continuized=continuized,
        timeout=30,
    )
    assert threads_of_a2cid2()
    # At least STEPS steps, more (up to 3x) while this rank has averaged fewer than MIN_AVERAGINGS
    # times: the pairing threads' pace depends on the CPU the test gets (on cores shared with a
    # training run it fell to 42 averagings in 300 steps), and what is tested is the convergence
    # and the shutdown, not that pace.
    steps = 0
    while steps < STEPS or (optimizer.averagings < MIN_AVERAGINGS and steps < 3 * STEPS):
        optimizer.zero_grad()
        (0.5 * (inputs @ weight - targets).square().mean()).backward()
        optimizer.step()
        steps += 1
        time.sleep(0.002)  # a step of a few ms: pairing (a few store round trips) keeps up
    distance = optimizer.consensus_distance(relative=True)
    averagings = optimizer.averagings
    optimizer.close()
    try:
        optimizer.step()
        stepped_after_close = True
    except RuntimeError:
        stepped_after_close = False
    return {
        "weight": weight.detach().clone(),
        "averagings": averagings,
        "distance": distance,
        "threads_left": threads_of_a2cid2(),
        "open": shutdown.open_count(),
        "stepped_after_close": stepped_after_close,
    }


@pytest.mark.parametrize("continuized", [True, False], ids=["a2cid2", "async-gossip"])
def test_four_processes_converge_to_the_allreduce_solution_and_leave_with_one_model(
    continuized: bool,
) -> None:
    results = run_distributed(convergence_worker, 4, continuized, timeout_s=120)
    reference = allreduce_sgd()
    start_error = float(reference.norm())  # every rank starts from rank 0's zeros
    for result in results:
        assert result["averagings"] >= MIN_AVERAGINGS, result["averagings"]  # rate 1: up to one per step
        assert result["distance"] < 1e-2
        # close(): the exact average, the same on every rank, threads ended, nothing left open
        torch.testing.assert_close(result["weight"], results[0]["weight"], rtol=0, atol=0)
        assert result["threads_left"] == [] and result["open"] == 0 and not result["stepped_after_close"]
    error = float((results[0]["weight"] - reference).norm())
    assert error < 0.02 * start_error, (error, start_error)


FAST_STEPS = 60


def straggler_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 3 takes one step, then stalls (in a barrier) until ranks 0-2 have taken FAST_STEPS each."""
    torch.manual_seed(0)
    model = nn.Linear(32, 1)
    optimizer = A2CiD2(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), graph="ring", timeout=30)
    inputs = torch.randn(64, 32)
    dist.barrier()
    for _ in range(1 if rank == 3 else FAST_STEPS):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
        time.sleep(0.002)
    dist.barrier()  # the straggler passes it only once the others have finished their steps
    steps, averagings = optimizer.step_count, optimizer.averagings
    optimizer.close()
    return {"steps": steps, "averagings": averagings}


def test_a_straggler_does_not_hold_back_the_other_ranks() -> None:
    """Event order, not wall-clock ratios: the fast ranks finish all their steps, averaging among
    themselves, while the straggler has taken one (a protocol that waited for it would hang)."""
    results = run_distributed(straggler_worker, 4, timeout_s=120)
    assert [r["steps"] for r in results] == [FAST_STEPS] * 3 + [1]
    assert min(r["averagings"] for r in results[:3]) > 0


def killed_worker(rank: int, world_size: int, victim: int) -> dict[str, Any]:
    model = nn.Linear(8, 1)
    optimizer = A2CiD2(torch.optim.SGD(model.parameters(), lr=0.01), graph="ring", timeout=3.0)
    inputs = torch.randn(16, 8)
    for step in range(100_000):
        if rank == victim and step == 30:
            os._exit(1)  # killed: no close, no goodbye
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        try:
            optimizer.step()
        except PeerFailure as error:
            failed_at = time.monotonic()
            message = str(error)
            break
        time.sleep(0.005)
    else:
        raise AssertionError("no error")
    try:
        optimizer.close()  # after a reported failure: no final average, no hang, no second error
    except Exception as error:  # pragma: no cover - reported to the test
        return {"message": message, "close_error": repr(error)}
    # Stay up until the other survivors have seen the failure too: a survivor that exits ends the
    # exchanges still running with it, and their error would then (rightly) name it instead.
    time.sleep(2.0)
    return {"message": message, "close_error": None, "steps": step, "failed_at": failed_at}


@pytest.mark.parametrize("victim", [2, 0], ids=["rank-2", "rank-0-hosting-the-matchmaker"])
def test_a_killed_rank_gives_the_others_an_error_not_a_hang(victim: int) -> None:
    results = run_distributed(killed_worker, 4, victim, timeout_s=90, allow_missing=frozenset({victim}))
    named = {}  # rank -> the other ranks its error names
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert result["close_error"] is None, result
        named[rank] = {int(r) for r in re.findall(r"rank (\d+)", result["message"])} - {rank}
    # Each survivor's error names the victim, or a survivor whose own error names it: failures
    # cascade (a survivor that fails closes its exchanges, and its partner's error then names it),
    # but every chain leads back to the killed rank.
    for rank, others in named.items():
        direct = victim in others
        via = any(victim in named.get(other, set()) for other in others)
        assert direct or via, (rank, results[rank]["message"], named)
