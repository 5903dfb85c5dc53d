"""The held-update probe (benchmarks/parity/held_update.py) equals its formula written out.

``x(t+1) = W(t+1) (x(t) - lr u(g(x(t-1))))``: n simulated ranks of the probe against n plain
AdamW steps taken from the mixed point with the gradient of the point before, and the topology's
mixing matrices; the probe's scale runs mean nothing unless this holds.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity.held_update import HeldUpdateAdam, PredictedHeldAdam
from decentadam import Comm, Local, Setting
from decentadam.simulation import SimulatedCluster
from decentadam.topology import build
from tests.test_decentralized import BETAS, EPS, LR, WD, flat, loss_of, make_model, param_groups

STEPS = 12


def run_probe(name: str, world_size: int, probe: type[HeldUpdateAdam] = HeldUpdateAdam) -> torch.Tensor:
    cluster = SimulatedCluster(world_size)
    models = [make_model(seed=100 + rank) for rank in range(world_size)]
    optimizers = [
        probe(
            param_groups(model),
            lr=LR,
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
        for optimizer in optimizers:
            optimizer.step()
    return torch.stack([flat(m) for m in models])


def written_out(name: str, world_size: int, predict: bool = False) -> torch.Tensor:
    """Each rank's AdamW on a scratch copy: from the mixed point, with the gradient of the last one
    (``predict``: the gradient at the mixed point plus its last displacement)."""
    topology = build(name, world_size, 1)
    here = [make_model(seed=100) for _ in range(world_size)]  # x: where gradients are taken
    scratch = [make_model(seed=100) for _ in range(world_size)]  # y = x - lr u, as sent
    adams = [torch.optim.AdamW(param_groups(m), lr=LR, betas=BETAS, eps=EPS) for m in scratch]
    held = torch.stack([flat(m) for m in here])  # x(t), the mixed points
    for step in range(STEPS):
        grads = []
        for rank, model in enumerate(here):
            model.zero_grad()
            loss_of(model, rank, step).backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        sent = torch.stack([flat(m) for m in scratch])
        mixed = topology.mixing_matrix(step) @ sent if step else sent  # nothing in flight at the first step
        point = 2 * mixed - held if predict else mixed
        held = mixed
        for rank in range(world_size):
            torch.nn.utils.vector_to_parameters(point[rank].clone(), here[rank].parameters())  # no aliases
            torch.nn.utils.vector_to_parameters(mixed[rank].clone(), scratch[rank].parameters())
            for param, grad in zip(scratch[rank].parameters(), grads[rank], strict=True):
                param.grad = grad
            adams[rank].step()
    return torch.stack([flat(m) for m in here])


@pytest.mark.parametrize("predict", [False, True], ids=["held", "predicted"])
@pytest.mark.parametrize("name", ["complete", "one-peer-exp", "ring"])
def test_held_update_equals_mixing_the_sent_points(name: str, predict: bool) -> None:
    got = run_probe(name, 4, PredictedHeldAdam if predict else HeldUpdateAdam)
    expected = written_out(name, 4, predict)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    if name == "complete":  # All-Reduce one step late: every rank holds the same point
        torch.testing.assert_close(got, got[:1].expand_as(got), rtol=0, atol=1e-12)
    assert WD > 0  # the groups' decoupled weight decay is part of what is compared


def test_held_update_refuses_what_it_replaces() -> None:
    cluster = SimulatedCluster(1)
    with pytest.raises(ValueError, match="sync_steps=0"):
        HeldUpdateAdam(
            make_model(seed=1).parameters(),
            lr=LR,
            setting=Setting(sync_steps=3),
            comm=Comm(communicator=cluster.communicator(0)),
        )
