"""The lag estimator of benchmarks.parity.lag_estimator: AdamW at n = 1, and an oscillating mean kept."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from benchmarks.parity.lag_estimator import lag_update
from decentadam import AccumAdamW

BETAS, EPS, LR = (0.9, 0.98), 1e-8, 1e-2


def steps(gradients: list[torch.Tensor], noise_ranks: int, lag: bool) -> list[torch.Tensor]:
    """The parameter after each step from 0 with these gradients, by lag_update or AccumAdamW."""
    param = torch.zeros_like(gradients[0], dtype=torch.float64)
    group = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0, "noise_ranks": noise_ranks}
    optimizer = AccumAdamW([param], lr=LR, betas=BETAS, eps=EPS, noise_ranks=noise_ranks)
    state: dict[torch.Tensor, dict[str, object]] = defaultdict(dict)
    out = []
    for g in gradients:
        param.grad = g.double()
        if lag:
            lag_update(state, group, [param])  # type: ignore[arg-type]
        else:
            optimizer.step()
        out.append(param.detach().clone())
    return out


def test_one_rank_is_adamw() -> None:
    gradients = list(torch.randn(12, 5, generator=torch.Generator().manual_seed(0)))
    for ours, adamw in zip(steps(gradients, 1, lag=True), steps(gradients, 1, lag=False), strict=True):
        torch.testing.assert_close(ours, adamw, rtol=1e-12, atol=1e-15)


def test_an_oscillating_mean_keeps_its_step_where_the_momentum_estimator_grows_it() -> None:
    """A noiseless gradient that flips sign every step: no noise to remove, so All-Reduce's step
    is AdamW's. The lag product sees the mean's square and keeps it; the deviation from the
    momentum counts the oscillation as noise and lets the step grow towards sqrt(n) = 2."""
    gradients = [torch.full((3,), (-1.0) ** t) for t in range(60)]
    adamw = steps(gradients, 1, lag=False)
    lag, momentum = steps(gradients, 4, lag=True), steps(gradients, 4, lag=False)
    last = [abs(float((run[-1] - run[-2])[0])) for run in (adamw, lag, momentum)]
    assert last[1] == pytest.approx(last[0], rel=1e-9)  # the same step as AdamW's
    assert last[2] > 1.5 * last[0]


def test_pure_noise_is_removed() -> None:
    """Zero-mean independent gradients: the lag product is small, v shrinks towards v / n and the
    steps grow (by less than sqrt(n), as the lag estimate keeps some noise)."""
    gradients = list(torch.randn(400, 2000, generator=torch.Generator().manual_seed(1)))
    one, four = steps(gradients, 1, lag=True), steps(gradients, 4, lag=True)
    ratio = float((four[-1] - four[-2]).norm() / (one[-1] - one[-2]).norm())
    assert 1.4 < ratio < 2.0
