"""The cluster benchmark's worker outside the emulated cluster: CPU accounting, the exchange-only method."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import pytest

from benchmarks.cluster.worker import (
    EmulatedModel,
    RankResult,
    WorkerSpec,
    busy_share,
    host_cpu_jiffies,
    run_exchange,
)
from decentadam.shutdown import close_all
from tests.distributed_harness import run_distributed

STAT = """cpu  100 5 40 800 20 3 7 2 0 0
cpu0 50 2 20 400 10 1 3 1 0 0
cpu1 50 3 20 400 10 2 4 1 0 0
intr 12345
"""


def test_host_cpu_jiffies_reads_the_aggregate_line() -> None:
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    assert host_cpu_jiffies(STAT) == (100 + 5 + 40 + 3 + 7 + 2, 977)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        host_cpu_jiffies("cpu0 1 2 3 4 5 6 7 8\n")


def test_busy_share_between_two_readings() -> None:
    assert busy_share((157, 977), (257, 1177)) == pytest.approx(0.5)
    assert busy_share((1, 10), (1, 10)) == 0.0  # no time passed: nothing to divide
    busy, total = host_cpu_jiffies()  # this machine's counters parse too
    assert 0 <= busy <= total


def exchange_worker(rank: int, world_size: int, topology: str) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    spec = WorkerSpec(
        method="exchange",
        out="",
        topology=topology,
        param_bytes=4 * 8 * 1000,
        layers=8,
        compute_ms=0.0,
        warmup=1,
        iters=4,
        bucket_mb=4 * 3000 / 2**20,  # 3 parameters of 1000 floats per bucket: buckets of 3, 3, 2
    )
    result = RankResult(rank=rank, start=0.0)
    run_exchange(spec, EmulatedModel(spec, rank), result)
    close_all()
    return asdict(result)


@pytest.mark.parametrize("topology", ["aer", "ring"])
def test_exchange_method_times_every_step_and_counts_the_buffers(topology: str) -> None:
    results = run_distributed(exchange_worker, 4, topology, timeout_s=120.0)
    for rank, result in enumerate(results):
        assert len(result["ends"]) == 4 and result["ends"] == sorted(result["ends"])
        assert result["start"] <= result["ends"][0]
        assert all(w >= 0 for w in result["wait_s"]) and result["update_s"] == [0.0] * 4
        # every step of aer and ring sums the whole model over a group of at least 2 ranks
        assert result["bytes_sent"] == 4 * 4 * 8 * 1000
        if rank == 0:
            assert 0.0 <= result["cpu_busy"] <= 1.0
        else:
            assert result["cpu_busy"] == -1.0
