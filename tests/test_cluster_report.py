"""The cluster benchmark's bookkeeping over repeated runs, and its report, on made-up worker results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib (pip install '.[bench]')")

from benchmarks.cluster.cases import BenchConfig, Case, Outcome, predictions, summarize
from benchmarks.cluster.report import write_report
from benchmarks.cluster.run import parse_args
from decentadam.runtime_model import ALLREDUCE, Cluster
from tests.pictures import assert_drawn

CONFIG = BenchConfig(nodes=2, ranks_per_node=2, iters=4, repeats=2, stragglers=False)
CALIBRATION = {"adamw_s": 0.001, "ours_update_s": 0.002}
CLUSTER = Cluster(nodes=2, ranks_per_node=2, inter_bytes_per_s=118e6, intra_bytes_per_s=2e9)


def fake_run(iteration_s: float, link_bytes: int = 4_000_000) -> dict[str, Any]:
    """Every rank takes ``iteration_s`` per iteration, rank r starting r ms late."""
    ranks = []
    for r in range(CONFIG.world_size):
        start = 10.0 + r * 1e-3
        ranks.append(
            {
                "start": start,
                "ends": [start + (i + 1) * iteration_s for i in range(CONFIG.iters)],
                "wait_s": [0.01] * CONFIG.iters,
                "update_s": [0.02] * CONFIG.iters,
                "link_bytes_out": link_bytes,
                "bytes_sent": 8_000_000,
                "cpu_busy": 0.5 + 0.1 * iteration_s if r == 0 else -1.0,  # rank 0 reads /proc/stat
            }
        )
    return {"ranks": ranks}


def outcome(case: Case, *iteration_s: float) -> Outcome:
    return summarize(
        case, [fake_run(s) for s in iteration_s], CONFIG, *predictions(case, CONFIG, CALIBRATION, CLUSTER)
    )


def test_repeats_give_the_mean_of_the_runs_and_pool_their_iterations() -> None:
    o = outcome(Case("decentadam", "ours", "aer"), 0.4, 0.6)
    assert o.run_means_ms == pytest.approx([400.0, 600.0])
    assert o.mean_ms == pytest.approx(500.0)
    assert o.median_ms == pytest.approx(500.0)  # half the iterations took 400 ms, half 600
    assert o.p90_ms == pytest.approx(600.0)
    # link bytes are per rank and iteration, whatever the number of runs
    assert o.inter_mb_per_rank == pytest.approx(4.0 / CONFIG.iters)
    assert o.buffer_mb_per_rank == pytest.approx(8.0 / CONFIG.iters)
    assert [len(run) for run in o.raw["runs"]] == [CONFIG.world_size] * 2
    assert o.cpu_busy == pytest.approx(0.55)  # rank 0's share, averaged over the runs


def test_report_states_the_mean_ratio_and_each_run(tmp_path: Path) -> None:
    ar = outcome(Case("torch DDP", "allreduce", ALLREDUCE), 1.0, 1.2)
    aer = outcome(Case("decentadam", "ours", "aer"), 0.45, 0.62)
    hooks = outcome(Case("decentadam", "ours", "aer", overlap="backward"), 0.44, 0.55)
    flat = outcome(Case("decentadam", "ours", "aer", hierarchical=False), 0.2, 0.2)  # not the target case
    md, png, raw = write_report(
        tmp_path,
        CONFIG,
        "run.py --repeats 2",
        {
            "inter": {"bytes": 1, "bytes_per_s": 118e6, "tbf_bytes": 1, "streams": 1},
            "duplex": {"bytes": 2, "bytes_per_s": 117e6, "tbf_bytes": 2, "streams": 2},
            "intra": {"bytes": 1, "bytes_per_s": 2e9, "tbf_bytes": 0, "streams": 4},
        },
        CALIBRATION,
        [ar, flat, aer, hooks],
        60.0,
        {"cpu": "cpu", "cores": "2", "kernel": "k", "python": "3", "torch": "2", "date": "d", "load": "0"},
        spec_summary={"prefix": "t"},
        alone={"aer": {"measured_ms": 321.0, "predicted_ms": 300.0, "cpu_busy": 0.74}},
    )
    text = md.read_text()
    assert "= **0.49x** (target <= 0.5x): PASS; run by run (paired by round): 0.45x, 0.52x" in text
    assert "| decentadam aer | 535 | 450, 620 |" in text
    assert "| decentadam aer (flat rings) | 200 | 200, 200 |" in text
    hooks_line = (
        "(updates from backward hooks): 495 ms = **0.45x** All-Reduce (PASS; run by run: 0.44x, 0.46x)"
    )
    assert hooks_line in text
    assert "every configuration ran 2 times" in text
    assert "| aer | 321 | 300 | -6.5% | 74% |" in text  # exchanges alone
    assert "take 321 ms per step: " in text
    assert "cores were 55% busy during AER's measured iterations (61% during All-Reduce's" in text
    assert "| TCP node 0 <-> node 1 (one stream each way at once), per stream: B_inter | 117.0 MB/s |" in text
    assert_drawn(png, (880, 528))  # 8 x 4.8 inches at 110 dpi, bars drawn
    saved = json.loads(raw.read_text())
    assert saved["outcomes"][2]["run_means_ms"] == pytest.approx([450.0, 620.0])
    assert [len(run) for run in saved["outcomes"][2]["runs"]] == [CONFIG.world_size] * 2


def test_repeats_must_be_positive() -> None:
    assert parse_args(["--repeats", "3"])[0].repeats == 3
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
