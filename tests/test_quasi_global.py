"""The quasi-global momentum probe (benchmarks/parity/quasi_global.py) equals its formula written out.

``x(t+1) = (1 - lr wd) W(t) x(t) - lr (D(t) + Q(t))``, ``Q(t) = beta1 (Q(t-1) + c(t-1))``, ``c(t) =
(x(t) - W(t) x(t)) / lr``: n simulated ranks of the probe against each rank's plain AdamW step from
its mixed point with the gradient of its unmixed one, plus the carried displacement; the probe's
scale runs mean nothing unless this holds.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity.quasi_global import QuasiGlobalAdam
from decentadam import Comm, Local, Setting
from decentadam.simulation import SimulatedCluster
from decentadam.topology import build
from tests.test_decentralized import BETAS, EPS, LR, WD, flat, loss_of, make_model, param_groups

STEPS = 12


def rate(step: int) -> float:
    return LR * min(1.0, (step + 1) / 4)  # a warm-up: c(t) is divided by the rate x(t) was made with


def run_probe(name: str, world_size: int) -> torch.Tensor:
    cluster = SimulatedCluster(world_size)
    models = [make_model(seed=100 + rank) for rank in range(world_size)]
    optimizers = [
        QuasiGlobalAdam(
            param_groups(model),
            lr=rate(0),
            betas=BETAS,
            eps=EPS,
            setting=Setting(topology=name, second_moment=Local()),
            comm=Comm(local_world_size=1, bucket_size_mb=1e-4, communicator=cluster.communicator(rank)),
        )
        for rank, model in enumerate(models)
    ]
    for step in range(STEPS):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            for group in optimizer.param_groups:
                group["lr"] = rate(step)
        for optimizer in optimizers:
            optimizer.step()
    return torch.stack([flat(m) for m in models])


def written_out(name: str, world_size: int) -> torch.Tensor:
    topology = build(name, world_size, 1)
    models = [make_model(seed=100) for _ in range(world_size)]  # rank 0's weights, as broadcast
    adams = [torch.optim.AdamW(param_groups(m), lr=rate(0), betas=BETAS, eps=EPS) for m in models]
    carried = torch.zeros(world_size, flat(models[0]).numel(), dtype=torch.float64)
    moved = torch.zeros_like(carried)
    for step in range(STEPS):
        points = torch.stack([flat(m) for m in models])
        for rank, model in enumerate(models):
            model.zero_grad()
            loss_of(model, rank, step).backward()  # the gradient at the unmixed x(t)
        mixed = topology.mixing_matrix(step) @ points if step else points  # nothing in flight at first
        carried = BETAS[0] * (carried + moved)
        moved = (points - mixed) / rate(step - 1) if step else torch.zeros_like(points)
        for rank, (model, adam) in enumerate(zip(models, adams, strict=True)):
            grads = [p.grad.detach().clone() for p in model.parameters()]
            torch.nn.utils.vector_to_parameters(mixed[rank].clone(), model.parameters())
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
            for group in adam.param_groups:
                group["lr"] = rate(step)
            adam.step()
            moved_on = flat(model) - rate(step) * carried[rank]
            torch.nn.utils.vector_to_parameters(moved_on, model.parameters())
    return torch.stack([flat(m) for m in models])


@pytest.mark.parametrize("name", ["complete", "one-peer-exp", "ring"])
def test_quasi_global_momentum_equals_its_formula(name: str) -> None:
    got = run_probe(name, 4)
    expected = written_out(name, 4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert WD > 0  # the groups' decoupled weight decay is part of what is compared
    assert (got - got.mean(0)).abs().max() > 1e-6  # the ranks differ: the mixing moved them


def test_quasi_global_momentum_on_one_rank_is_adamw() -> None:
    cluster = SimulatedCluster(1)
    model, reference = make_model(seed=3), make_model(seed=3)
    probe = QuasiGlobalAdam(
        param_groups(model), lr=LR, betas=BETAS, eps=EPS, setting=Setting(second_moment=Local()),
        comm=Comm(communicator=cluster.communicator(0)),
    )  # fmt: skip
    adamw = torch.optim.AdamW(param_groups(reference), lr=LR, betas=BETAS, eps=EPS)
    for step in range(STEPS):
        for m, optimizer in ((model, probe), (reference, adamw)):
            optimizer.zero_grad()
            loss_of(m, 0, step).backward()
            optimizer.step()
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=1e-12)


def test_quasi_global_momentum_refuses_what_it_replaces() -> None:
    cluster = SimulatedCluster(1)
    with pytest.raises(ValueError, match="sync_steps=0"):
        QuasiGlobalAdam(
            make_model(seed=1).parameters(), lr=LR, setting=Setting(sync_steps=3),
            comm=Comm(communicator=cluster.communicator(0)),
        )  # fmt: skip
