"""benchmarks.parity.deviation_filter: the filter of each rank's known deviation, on simulated ranks.

Pins what docs/parity.md's screen relies on: with ``(c1, c2) = (0, 0)`` the probe is
``DecentralizedAdam`` bit for bit; otherwise each rank sends its step minus ``lr phi``, with
``phi = b1 phi + c1 k(t) + c2 k(t-1)`` and ``k(t) = (mix_i(t) - x_i(t)) / lr``, and on the complete
graph the ranks' ``phi`` sum to zero (the mean's step is the unfiltered one).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from benchmarks.parity.deviation_filter import DeviationFilterAdam, filter_coefficients
from decentadam import DecentralizedAdam
from decentadam.simulation import SimulatedCluster

RANKS, BETAS, EPS, LR, STEPS = 4, (0.9, 0.98), 1e-8, 1e-2, 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def run(
    make: Any, topology: str, **kwargs: Any
) -> tuple[list[list[Tensor]], list[DecentralizedAdam], list[nn.Module]]:
    """``STEPS`` lock-step steps of ``RANKS`` simulated ranks; every rank's weights before each."""
    cluster = SimulatedCluster(RANKS)
    models = [make_model() for _ in range(RANKS)]
    optimizers = [
        make(
            m.parameters(), lr=LR, betas=BETAS, eps=EPS, topology=topology, second_moment="local",
            communicator=cluster.communicator(rank), **kwargs,
        )
        for rank, m in enumerate(models)
    ]  # fmt: skip
    weights: list[list[Tensor]] = []
    for step in range(STEPS):
        weights.append([flat(list(m.parameters())) for m in models])
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            x = torch.randn(
                8, 4, generator=torch.Generator().manual_seed(100 * rank + step), dtype=torch.float64
            )
            nn.functional.mse_loss(model(x), x[:, :2].sin()).backward()  # type: ignore[no-untyped-call]
        for optimizer in optimizers:
            optimizer.step()
    weights.append([flat(list(m.parameters())) for m in models])
    return weights, optimizers, models


@pytest.mark.parametrize("topology", ["complete", "aer"])
def test_without_a_filter_it_is_decentralized_adam(topology: str) -> None:
    plain, _, _ = run(DecentralizedAdam, topology)
    probe, _, _ = run(DeviationFilterAdam, topology, coefficients=(0.0, 0.0))
    for a, b in zip(plain, probe, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_the_filter_follows_its_recurrence_and_sums_to_zero_on_the_complete_graph() -> None:
    c1, c2 = 0.4, -0.5
    weights, optimizers, models = run(DeviationFilterAdam, "complete", coefficients=(c1, c2))
    plain, _, _ = run(DecentralizedAdam, "complete")
    assert not torch.equal(weights[-1][0], plain[-1][0])  # the filter changed the run
    phi = [torch.zeros_like(weights[0][0]) for _ in range(RANKS)]
    previous: list[Tensor | None] = [None] * RANKS
    for step in range(STEPS):
        mean = torch.stack(weights[step]).mean(0)
        for rank in range(RANKS):
            known = (mean - weights[step][rank]) / LR if step > 0 else None  # lr is constant here
            phi[rank] = BETAS[0] * phi[rank]
            if known is not None:
                phi[rank] += c1 * known
            last = previous[rank]
            if last is not None:
                phi[rank] += c2 * last
            previous[rank] = known
        torch.testing.assert_close(torch.stack(phi).sum(0), torch.zeros_like(phi[0]), rtol=0, atol=1e-12)
    for rank, (optimizer, model) in enumerate(zip(optimizers, models, strict=True)):
        assert isinstance(optimizer, DeviationFilterAdam)
        held = flat([optimizer._phi[p] for p in model.parameters()])
        torch.testing.assert_close(held, phi[rank], rtol=1e-10, atol=1e-12)
        # what the rank sent: the mixed weights minus lr times (Adam's direction + phi)
        bc1, bc2 = 1 - BETAS[0] ** STEPS, 1 - BETAS[1] ** STEPS
        direction = flat(
            [
                optimizer.state[p]["exp_avg"] / bc1 / ((optimizer.state[p]["exp_avg_sq"] / bc2).sqrt() + EPS)
                for p in model.parameters()
            ]
        )
        expected = torch.stack(weights[STEPS - 1]).mean(0) - LR * (direction + phi[rank])
        torch.testing.assert_close(weights[STEPS][rank], expected, rtol=1e-10, atol=1e-12)


def test_coefficients_are_read_and_checked() -> None:
    assert filter_coefficients("0.3,-0.4") == (0.3, -0.4)
    with pytest.raises(ValueError, match="two numbers"):
        filter_coefficients("0.3")
