"""benchmarks.time_to_quality.scale: the runtime model calibrated on the paper's cluster, and the
predicted time to quality at 16 and 32 nodes from a small synthetic grid of parity runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.parity.scale import ALWAYS
from benchmarks.time_to_quality import cli, scale
from decentadam.runtime_model import ALLREDUCE, Cluster, Workload, predict


@pytest.fixture(scope="module")
def size() -> float:
    return float(scale.param_bytes(scale.PAPER.preset))


def test_the_paper_s_model_is_transformer_base_and_the_calibration_gives_its_two_iterations(
    size: float,
) -> None:
    assert 60e6 < size / 4 < 65e6  # Transformer-base with a 32k joint vocabulary: about 61M parameters
    compute_s, bandwidth = scale.calibrate(scale.PAPER, size)
    for method, published in ((ALLREDUCE, scale.PAPER.allreduce_ms), ("aer", scale.PAPER.aer_ms)):
        got = scale._paper_iteration(scale.PAPER, size, method, compute_s, bandwidth)
        assert got * 1e3 == pytest.approx(published, rel=1e-4)
    assert 0 < compute_s < scale.PAPER.aer_ms / 1e3  # AER hides part of its communication, not all
    assert 0.5 < bandwidth * 8 / 1e9 / scale.PAPER.link_gbit < 1.0  # below the nominal 25 Gbit/s


def test_as_8_nodes_of_4_the_model_cannot_give_both_iterations(size: float) -> None:
    with pytest.raises(ValueError, match="no C"):
        scale.calibrate(scale.PaperCluster(nodes=8, gpus_per_node=4), size)


def run(
    method: str, nodes: int, seed: int, nll: list[float], options: dict[str, Any] | None
) -> dict[str, Any]:
    """A grid run as benchmarks.parity.scale writes it, evaluated every 100 of 400 steps."""
    return {
        "nodes": nodes,
        "ranks_per_node": 1,
        "method": method,
        "is_default": method == "default",
        "seed": seed,
        "steps": 400,
        "options": options,
        "inter_node_bytes_per_step": 1e6,
        "curve": [{"step": 100 * (i + 1), "valid_nll": v} for i, v in enumerate(nll)],
    }


def grid() -> list[dict[str, Any]]:
    records = []
    for nodes in (16, 32):
        for seed in (1, 2):
            records += [
                run("allreduce", nodes, seed, [6.0, 5.0, 4.0, {1: 3.1, 2: 3.2}[seed]], None),
                # reaches All-Reduce's final loss 2/3 of the way from step 300 to 400 on seed 1, at 400 on 2
                run("default", nodes, seed, [6.5, 5.5, 3.3, {1: 3.0, 2: 3.2}[seed]], {"local_world_size": 1}),
                run("exp-avg16", nodes, seed, [7.0, 6.0, 5.0, 4.0],
                    {"topology": "one-peer-exp", "exchange": "bf16_updates", "average_every": 16}),
                run("sync-aer-avg8-global-raw", nodes, seed, [6.0, 5.0, 4.0, 3.0],
                    {"topology": "aer", "exchange": "bf16_updates", "average_every": 8, "sync_steps": ALWAYS,
                     "second_moment": "Global(floored=False)"}),
            ]  # fmt: skip
    return records


def test_predicted_time_to_quality_is_steps_ratio_times_the_model_s_step_ratio(size: float) -> None:
    prediction = scale.predict_scale(grid(), size=size)
    compute_s, bandwidth = scale.calibrate(scale.PAPER, size)
    assert prediction["calibrated"]["compute_ms"] == pytest.approx(compute_s * 1e3)
    rows = {(r["nodes"], r["method"]): r for r in prediction["rows"]}
    assert set(rows) == {
        (n, m) for n in (16, 32) for m in ("allreduce", "default", "exp-avg16", "sync-aer-avg8-global-raw")
    }
    ar = rows[(16, "allreduce")]
    cluster = Cluster(16, 1, bandwidth, scale.PAPER.intra_gbit * 1e9 / 8)
    work = Workload(param_bytes=size, compute_s=compute_s, forward_fraction=scale.PAPER.forward_fraction)
    assert ar["iteration_ms"] == pytest.approx(predict(ALLREDUCE, cluster, work).iteration_s * 1e3)
    assert ar["steps_ratio"] == 1.0 and ar["time_ratio"] == pytest.approx(1.0)
    default = rows[(16, "default")]
    # seed 1: 3.1 reached 2/3 of the way from (300, 3.3) to (400, 3.0); seed 2: 3.2 at step 400
    steps = [s["steps_to_target"] for s in default["seeds"]]
    assert steps == pytest.approx([300 + 100 * 0.2 / 0.3, 400.0])
    assert default["steps_ratio"] == pytest.approx(sum(steps) / 2 / 400)
    assert default["time_ratio"] == pytest.approx(default["steps_ratio"] * default["iteration_ratio"])
    assert default["is_default"] and default["iteration_ratio"] < 1  # gossip is cheaper per step
    assert default["time_to_target_s"] == pytest.approx(sum(steps) / 2 * default["iteration_ms"] / 1e3)
    assert rows[(16, "exp-avg16")]["time_ratio"] is None  # never reaches it
    synchronous = rows[(32, "sync-aer-avg8-global-raw")]
    assert synchronous["iteration_ms"] > compute_s * 1e3  # C and its communication, one after the other
    assert rows[(32, "allreduce")]["iteration_ms"] > rows[(16, "allreduce")]["iteration_ms"]


def test_the_target_is_all_reduce_s_loss_at_the_last_common_step_or_at_the_step_asked(size: float) -> None:
    records = grid()
    longer = next(r for r in records if (r["method"], r["nodes"], r["seed"]) == ("allreduce", 16, 1))
    longer["curve"] += [{"step": 800, "valid_nll": 2.0}, {"step": 1200, "valid_nll": 1.5}]  # run to 1,200
    rows = {(r["nodes"], r["method"]): r for r in scale.predict_scale(records, size=size)["rows"]}
    default = rows[(16, "default")]["seeds"]
    assert [(s["target_step"], s["target_valid_nll"]) for s in default] == [(400, 3.1), (400, 3.2)]
    assert [s["steps_to_target"] for s in default] == pytest.approx([300 + 100 * 0.2 / 0.3, 400.0])
    ar = rows[(16, "allreduce")]["seeds"]
    assert [s["target_step"] for s in ar] == [1200, 400] and rows[(16, "allreduce")]["steps_ratio"] == 1.0

    earlier = scale.predict_scale(records, size=size, target_step=200)
    assert earlier["target_step"] == 200
    rows = {(r["nodes"], r["method"]): r for r in earlier["rows"]}
    exp = rows[(16, "exp-avg16")]  # never reaches 3.1 in 400 steps, but 5.0 (All-Reduce at 200) at 300
    assert [s["steps_to_target"] for s in exp["seeds"]] == [300.0, 300.0] and exp["steps_ratio"] == 1.5
    assert exp["time_ratio"] == pytest.approx(1.5 * exp["iteration_ratio"])
    far = scale.predict_scale(records, size=size, target_step=800)["rows"]
    assert [(r["nodes"], r["method"]) for r in far] == [(16, "allreduce")]  # the only run past step 800
    with pytest.raises(ValueError, match="no evaluation at step 250 \\(it has 100, 200, 300, 400\\)"):
        scale.predict_scale(grid(), size=size, target_step=250)


def test_the_command_writes_the_prediction_and_says_it_is_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for index, record in enumerate(grid()):
        (runs / f"{index}.json").write_text(json.dumps(record))
    assert cli.main(["--predict-scale", str(runs), "--out-dir", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "time_to_quality_scale.md").read_text()
    assert md.startswith("# Predicted time to quality at scale (the runtime model's, not a measurement)")
    assert "| 32 x 1 | default (default) |" in md and "published 188.5 ms All-Reduce and 67.9 ms AER" in md
    assert (
        "Target: All-Reduce's validation loss (same nodes and seed) at the last step both runs reached." in md
    )
    data = json.loads((tmp_path / "out" / "time_to_quality_scale.json").read_text())
    assert len(data["rows"]) == 8
    (runs / "bad.json").write_text(json.dumps({"method": "x"}))
    with pytest.raises(SystemExit):
        cli.main(["--predict-scale", str(runs)])
    assert "expected benchmarks.parity.scale runs" in capsys.readouterr().err


def test_runs_at_several_rates_are_rows_of_their_own_against_all_reduce_at_its_best_rate(
    tmp_path: Path,
) -> None:
    folders = [tmp_path / "runs", tmp_path / "lr-1e-3"]
    for folder in folders:
        folder.mkdir()
    command = "python -m benchmarks.parity.scale run --nodes 32 --method {} --seed 1"
    runs = {  # the preset's rate (2e-3) where the command names none
        "runs/allreduce": (run("allreduce", 32, 1, [6.0, 5.0, 4.0, 3.0], None), ""),
        "lr-1e-3/allreduce": (run("allreduce", 32, 1, [5.5, 4.5, 4.2, 3.9], None), " optim.lr=1e-3"),
        "runs/default": (run("default", 32, 1, [6.5, 5.5, 4.5, 4.0], {}), ""),
        "lr-1e-3/default": (run("default", 32, 1, [6.5, 5.0, 4.0, 3.0], {}), " optim.lr=1e-3"),
    }
    for name, (record, rate) in runs.items():
        record["command"] = command.format(record["method"]) + rate
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    out = tmp_path / "out"
    assert cli.main(["--predict-scale", *map(str, folders), "--out-dir", str(out)]) == 0
    rows = json.loads((out / "time_to_quality_scale.json").read_text())["rows"]
    found = {(r["method"], r["lr"]): r for r in rows}
    assert set(found) == {("allreduce", 2e-3), ("default", 1e-3), ("default", 2e-3)}  # 3.0 < 3.9 at 400
    assert found["default", 1e-3]["steps_ratio"] == pytest.approx(1.0)  # 3.0 at step 400, as All-Reduce
    assert found["default", 2e-3]["steps_ratio"] is None  # never at 3.0
    md = (out / "time_to_quality_scale.md").read_text()
    assert "| 32 x 1 | default (default) | 0.001 | 1.00 |" in md


def test_nodes_of_one_and_of_two_are_rows_of_their_own_against_their_own_all_reduce(size: float) -> None:
    pairs = dict(ranks_per_node=2)
    records = [
        run("allreduce", 8, 1, [6.0, 5.0, 4.0, 3.0], None),  # 8 ranks
        run("allreduce", 16, 1, [6.0, 5.0, 4.0, 2.0], None),  # 16 ranks: All-Reduce of 8 x 2
        run("default", 8, 1, [6.0, 5.0, 4.0, 3.0], {"local_world_size": 1}),
        {**run("default", 8, 1, [6.0, 5.0, 4.0, 3.0], {"local_world_size": 2}), **pairs},
    ]
    rows = {
        (r["nodes"], r["ranks_per_node"], r["method"]): r
        for r in scale.predict_scale(records, size=size)["rows"]
    }
    assert (8, 1, "default") in rows and (8, 2, "default") in rows
    assert len(rows[(8, 1, "default")]["seeds"]) == len(rows[(8, 2, "default")]["seeds"]) == 1
    assert rows[(8, 1, "default")]["steps_ratio"] == 1.0  # on 8 ranks' All-Reduce curve
    assert rows[(8, 2, "default")]["steps_ratio"] is None  # 16 ranks' All-Reduce reaches 2.0: not reached
    md = scale.markdown(scale.predict_scale(records, size=size), "grid")
    assert "| 8 x 1 | default (default) |" in md and "| 8 x 2 | default (default) |" in md
