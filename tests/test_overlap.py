"""The exchange started by step t is still in flight while the forward/backward of step t+1 runs.

An instrumented communicator stands in for the network: an exchange "arrives" only when the test
releases it, and waiting on one that has not arrived fails instead of blocking. If step() waited
for its own exchange, or if the next forward/backward needed it, these tests would fail.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from benchmarks.gossip import plain
from decentadam import Comm, DecentralizedAdam
from decentadam.topology import Group


class ControlledExchange:
    def __init__(self, tensor: Tensor, log: list[str]) -> None:
        self.tensor, self.log, self.arrived = tensor, log, False

    def arrive(self) -> None:
        self.tensor.mul_(2)  # the peer holds the same parameters: the sum is twice ours
        self.arrived = True
        self.log.append("arrive")

    def wait(self, timeout: object = None) -> object:
        assert self.arrived, "step() waited for an exchange that the network had not delivered yet"
        self.log.append("wait")
        return True


class ControlledCommunicator:
    """Rank 0 of 2; records when exchanges start and are waited for."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.log: list[str] = []
        self.in_flight: list[ControlledExchange] = []

    def group_sum(self, tensor: Tensor, group: Group) -> ControlledExchange:
        self.log.append("start")
        exchange = ControlledExchange(tensor, self.log)
        self.in_flight.append(exchange)
        return exchange

    def deliver_all(self) -> None:
        for exchange in self.in_flight:
            exchange.arrive()
        self.in_flight.clear()

    def world_sum(self, tensor: Tensor) -> None:
        tensor.mul_(2)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        return None


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def forward_backward(model: nn.Module, log: list[str], label: str) -> None:
    model(torch.randn(4, 8)).sum().backward()
    log.append(label)


def test_exchange_of_step_t_travels_during_next_forward_backward() -> None:
    model, comm = make_model(), ControlledCommunicator()
    optimizer = DecentralizedAdam(
        model.parameters(),
        setting=plain("complete"),
        comm=Comm(bucket_size_mb=1e-3, communicator=comm),
    )

    optimizer.zero_grad()
    forward_backward(model, comm.log, "compute 0")
    optimizer.step()  # starts the exchange that step 1 will mix
    buckets = len(comm.in_flight)
    assert buckets > 1 and comm.log == ["compute 0"] + ["start"] * buckets

    after_step_0 = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    forward_backward(model, comm.log, "compute 1")  # runs while every exchange is in flight
    assert all(torch.equal(a, p) for a, p in zip(after_step_0, model.parameters(), strict=True))

    comm.deliver_all()
    optimizer.step()  # waits, mixes, updates, starts the next exchanges
    expected = ["compute 0"] + ["start"] * buckets + ["compute 1"] + ["arrive"] * buckets
    assert comm.log[: len(expected)] == expected
    assert comm.log[len(expected) :].count("wait") == buckets
    assert optimizer.stats.exchanges == 2 * buckets


def test_backward_mode_starts_exchanges_during_backward() -> None:
    model, comm = make_model(), ControlledCommunicator()
    optimizer = DecentralizedAdam(
        model.parameters(),
        setting=plain("complete"),
        comm=Comm(bucket_size_mb=1e-3, communicator=comm, overlap="backward"),
    )
    for step in range(2):  # the first iteration calibrates; the second runs from the hooks
        comm.deliver_all()  # the previous step's exchanges arrive during this forward
        optimizer.zero_grad()
        forward_backward(model, comm.log, f"backward {step} returned")
        optimizer.step()
    comm.deliver_all()
    comm.log.clear()
    optimizer.zero_grad()
    forward_backward(model, comm.log, "backward 2 returned")
    # Every bucket waited, mixed, updated and started its next exchange before backward returned.
    assert comm.log.index("backward 2 returned") == len(comm.log) - 1
    assert comm.log.count("start") == comm.log.count("wait") > 1
    optimizer.step()  # nothing left to do: all buckets were stepped in backward
    assert comm.log.count("start") == comm.log.count("wait")
