"""Group sums on real gloo process groups: the hierarchical path == one flat all-reduce."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from decentadam import Comm, DecentralizedAdam, Setting
from decentadam.collectives import ProcessGroupCommunicator, SingleProcessCommunicator, node_layout
from decentadam.shutdown import close_all
from decentadam.topology import build
from tests.distributed_harness import run_distributed

# numel 1 is below m (flat sum), 10_001 leaves a remainder of 1 for a flat sum, 4_096 splits evenly
SIZES = (1, 10_001, 4_096)


def test_node_layout_picks_groups_that_span_nodes_evenly() -> None:
    assert node_layout((0, 1, 2, 3), local_world_size=2) == [(0, 1), (2, 3)]
    assert node_layout((0, 1, 4, 5), local_world_size=2) == [(0, 1), (4, 5)]
    assert node_layout(tuple(range(8)), local_world_size=2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert node_layout((0, 1), local_world_size=2) is None  # one node: a plain all-reduce
    assert node_layout((0, 2), local_world_size=2) is None  # one rank per node: nothing to scatter
    assert node_layout((0, 1, 2), local_world_size=2) is None  # uneven: 2 ranks on node 0, 1 on node 1
    assert node_layout((0, 1, 2, 3), local_world_size=1) is None


def sum_worker(rank: int, world_size: int, topology_name: str, local: int) -> dict[str, Any]:
    topology = build(topology_name, world_size, local)
    communicator = ProcessGroupCommunicator(topology)
    flat = ProcessGroupCommunicator(topology, hierarchical=False)
    out: dict[str, Any] = {"hierarchical": communicator.hierarchical_groups, "sums": []}
    for step in range(topology.period):
        group = topology.group_of(rank, step)
        generator = torch.Generator().manual_seed(1000 * rank + step)
        inputs = [torch.randn(n, generator=generator) for n in SIZES]
        # All buffers in flight at once, as an optimizer's buckets are: the driver chains them in order.
        mine = [x.clone() for x in inputs]
        handles = [communicator.group_sum(x, group) for x in mine]
        reference = [x.clone() for x in inputs]
        for x in reference:
            flat.group_sum(x, group).wait()
        for handle in handles:
            handle.wait(timedelta(seconds=30))
            handle.wait()  # a second wait returns at once
        out["sums"].append({"group": group, "got": mine, "flat": reference})
    drivers = [t.name for t in threading.enumerate() if t.name == "decentadam-exchange"]
    close_all()
    out["drivers_before_release"] = len(drivers)
    out["drivers_after_release"] = sum(t.name == "decentadam-exchange" for t in threading.enumerate())
    dist.barrier()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("topology", "world_size", "local", "spanning"),
    [
        ("aer", 4, 2, [(0, 1, 2, 3)]),
        ("aer", 8, 2, [(0, 1, 2, 3), (0, 1, 4, 5), (2, 3, 6, 7), (4, 5, 6, 7)]),
        ("complete", 8, 2, [tuple(range(8))]),  # rails of 4 nodes
        ("aer", 8, 4, [tuple(range(8))]),  # 4 ranks per node: 4 shards
        ("ring", 4, 2, []),  # pairs across nodes hold one rank per node: flat sums only
    ],
)
def test_hierarchical_sum_equals_flat_all_reduce(
    topology: str, world_size: int, local: int, spanning: list[tuple[int, ...]]
) -> None:
    results = run_distributed(sum_worker, world_size, topology, local, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["hierarchical"] == sorted(g for g in spanning if rank in g), rank
        assert result["drivers_before_release"] == (1 if result["hierarchical"] else 0)
        assert result["drivers_after_release"] == 0
        for entry in result["sums"]:
            for got, flat in zip(entry["got"], entry["flat"], strict=True):
                torch.testing.assert_close(got, flat, rtol=1e-6, atol=1e-5)
    # Every member of a group holds the same sum, bit for bit: the ranks stay in consensus.
    for rank, result in enumerate(results):
        for step, entry in enumerate(result["sums"]):
            for other in entry["group"]:
                theirs = results[other]["sums"][step]
                assert theirs["group"] == entry["group"]
                for got, their in zip(entry["got"], theirs["got"], strict=True):
                    assert torch.equal(got, their), (rank, other, step)


def stalled_peer_worker(rank: int, world_size: int) -> tuple[str, float]:
    communicator = ProcessGroupCommunicator(build("aer", world_size, 2))
    if rank == 3:
        time.sleep(60)  # alive but never joins the exchange (killed by the harness)
    handle = communicator.group_sum(torch.ones(1000), (0, 1, 2, 3))
    started = time.monotonic()
    try:
        handle.wait(timedelta(seconds=2))
    except RuntimeError as error:
        return str(error), time.monotonic() - started
    return "no error", 0.0


@pytest.mark.timeout(120)
def test_a_stalled_peer_makes_the_wait_time_out() -> None:
    # Rank 2 waits in its node's reduce-scatter, ranks 0 and 1 in the all-reduce across nodes:
    # wherever the chain is stuck, the caller's wait ends after its timeout with an error.
    results = run_distributed(stalled_peer_worker, 4, allow_missing=frozenset({3}), timeout_s=90)
    for rank in (0, 1, 2):
        message, seconds = results[rank]
        assert "timed out after 2 s" in message, (rank, message)
        assert seconds < 2.0 + 3.0, (rank, seconds)


def optimizer_groups_worker(rank: int, world_size: int, hierarchical: bool) -> list[tuple[int, ...]]:
    model = torch.nn.Linear(8, 8)
    optimizer = DecentralizedAdam(
        model.parameters(),
        setting=Setting(topology="aer"),
        comm=Comm(local_world_size=2, hierarchical=hierarchical),
    )
    assert isinstance(optimizer.communicator, ProcessGroupCommunicator)
    planned = sorted(optimizer.communicator.hierarchical_groups)
    close_all()
    return planned


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_decentralized_adam_switches_hierarchical_sums(hierarchical: bool) -> None:
    results = run_distributed(optimizer_groups_worker, 4, hierarchical, timeout_s=90)
    assert results == [[(0, 1, 2, 3)] if hierarchical else []] * 4


def test_hierarchical_false_with_a_custom_communicator_is_refused() -> None:
    with pytest.raises(ValueError, match="hierarchical=False configures the default communicator"):
        DecentralizedAdam(
            torch.nn.Linear(2, 2).parameters(),
            comm=Comm(communicator=SingleProcessCommunicator(), hierarchical=False),
        )
