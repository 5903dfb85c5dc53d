"""The parity oracle, tiny: DecentralizedAdam fed the all-reduced gradient is All-Reduce AdamW.

On the complete graph with ``accum_steps=1`` and AdamW's betas, a DecentralizedAdam whose ranks'
gradients are replaced by their mean before each step (``benchmarks.parity.mean_gradients``'s
:class:`MeanGradientAdam`)
takes AdamW's step on DDP's gradient from the same weights: the losses and weights of the two runs
must agree to float64 rounding. (``python -m benchmarks.parity.oracle`` checks the same on the
translation recipe.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.parity.mean_gradients import MeanGradientAdam
from decentadam import DecentralizedAdam, Setting
from tests.distributed_harness import run_distributed

STEPS, LR, BETAS, EPS, WD = 25, 1e-2, (0.9, 0.98), 1e-9, 0.01


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    return nn.functional.mse_loss(model(x), torch.sin(x[:, :3] + x[:, 3:]))


def worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference = make_model()
    ddp = nn.parallel.DistributedDataParallel(reference)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    model = make_model()
    # The gradient is already the mean over all ranks, so the second moment must not remove noise again.
    decentralized = MeanGradientAdam(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        accum_steps=1,
        setting=Setting(second_moment="local", topology="complete"),
    )
    try:
        for name, net, optimizer in (("allreduce", ddp, adamw), ("oracle", model, decentralized)):
            losses = []
            for step in range(STEPS):
                optimizer.zero_grad()
                loss = loss_of(net, rank, step)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            out[name] = losses
    finally:
        decentralized.close()
    out["allreduce_weights"] = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    out["oracle_weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


def test_decentralized_adam_on_the_mean_gradient_is_allreduce_adamw() -> None:
    for rank, result in enumerate(run_distributed(worker, 4)):
        torch.testing.assert_close(result["oracle"], result["allreduce"], rtol=1e-12, atol=0)
        torch.testing.assert_close(
            result["oracle_weights"], result["allreduce_weights"], rtol=1e-10, atol=1e-13
        )
        assert result["allreduce"][-1] < 0.8 * result["allreduce"][0], f"rank {rank}: did not train"


def own_gradients(rank: int, world_size: int) -> list[float]:
    model = make_model()
    optimizer = DecentralizedAdam(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        accum_steps=1,
        setting=Setting(second_moment="local", topology="complete"),
    )
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    optimizer.close()
    return losses


def test_without_the_mean_gradient_the_ranks_take_different_steps() -> None:
    """The check has teeth: the same optimizer on each rank's own gradient leaves All-Reduce's path."""
    reference = run_distributed(worker, 2)
    mine = run_distributed(own_gradients, 2)
    assert max(abs(a - b) for a, b in zip(mine[0], reference[0]["allreduce"], strict=True)) > 1e-4
