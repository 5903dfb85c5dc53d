"""benchmarks.time_to_quality: the link-rate solver, the run order, the load meter, the methods'
arguments, the report on made-up runs (its JSON schema and numbers, the goals and the notes), BLEU in
All-Reduce's time, argument errors, and (as root, with ``ip netns``) the whole command on a tiny model
and corpus. The alternatives' own runs: tests/test_time_to_quality_alternatives.py; the scale
prediction: tests/test_time_to_quality_scale.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib (pip install '.[bench]')")

from benchmarks.thresholds import TTQ_DEFAULT_RATIO
from benchmarks.time_to_quality import cli, curves, launch, methods, notes, rates
from benchmarks.time_to_quality import report as reporting
from benchmarks.time_to_quality.methods import Job, run_order
from benchmarks.time_to_quality.settings import parse_args
from decentadam.options import SETTINGS, Setting
from tests.pictures import assert_drawn

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------ the link rate


def test_rate_makes_allreduce_communicate_one_and_a_half_compute() -> None:
    compute_s, param_bytes = 1.1, 30e6
    rate = rates.solve_rate_mbit(compute_s, param_bytes)
    assert rates.allreduce_comm_s(rate, param_bytes) == pytest.approx(1.5 * compute_s, rel=5e-3)
    # 2 x 2 ranks: the ring crosses each node link with 2 (n-1)/n S = 1.5 S per direction
    assert rate == pytest.approx(1.5 * param_bytes * 8 / 1e6 / (1.5 * compute_s), rel=5e-3)
    assert rates.solve_rate_mbit(compute_s, param_bytes, ratio=3.0) == pytest.approx(rate / 2, rel=5e-3)
    assert rate == float(f"{rate:.3g}")  # printed and used with 3 significant digits


@pytest.mark.parametrize("args", [(0.0, 30e6), (1.0, 0.0), (1.0, 30e6, -1.0)])
def test_rate_solver_rejects_non_positive_inputs(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        rates.solve_rate_mbit(*args)


def test_the_bisection_solves_rising_and_falling_functions_and_says_when_it_cannot() -> None:
    assert rates.solve(lambda x: x**2, 9.0, 1e-3, 1e3, "x") == pytest.approx(3.0, rel=1e-8)
    assert rates.solve(lambda x: 1 / x, 4.0, 1e-3, 1e3, "x") == pytest.approx(0.25, rel=1e-8)
    with pytest.raises(ValueError, match="no the thing in"):
        rates.solve(lambda x: x, 1e4, 1.0, 10.0, "the thing")


# ------------------------------------------------------------------------------------ methods, order, load


def test_all_reduce_starts_every_seed_and_the_others_alternate_once_per_seed_and_rate() -> None:
    names = ["allreduce", "powersgd", "postlocal", "decentadam-default"]
    jobs = run_order(names, [1, 2], [1e-3])
    assert [(j.method, j.seed) for j in jobs] == [
        ("allreduce", 1), ("powersgd", 1), ("postlocal", 1), ("decentadam-default", 1),
        ("allreduce", 2), ("decentadam-default", 2), ("postlocal", 2), ("powersgd", 2),
    ]  # fmt: skip
    # the others train for All-Reduce's time of their seed, so it runs first in each seed; the mean
    # position of every other method over the two seeds is the same: a linear drift cancels
    positions = {name: [i for i, j in enumerate(jobs) if j.method == name] for name in names[1:]}
    assert len({sum(p) for p in positions.values()}) == 1
    grid = run_order(names, [1, 2, 3], [1e-3, 2e-3])
    assert len(grid) == 24 and len(set(grid)) == 24
    assert grid[:2] == [Job("allreduce", 1, 1e-3), Job("allreduce", 1, 2e-3)]
    assert grid[8:10] == [Job("allreduce", 2, 1e-3), Job("allreduce", 2, 2e-3)]
    assert grid[10] == Job("decentadam-default", 2, 2e-3) and grid[16] == Job("allreduce", 3, 1e-3)
    assert Job("powersgd", 2, 2e-3).key(grid=True) == "powersgd/lr=0.002/seed2"
    assert Job("powersgd", 2, 2e-3).key(grid=False) == "powersgd/seed2"


def test_every_other_training_gets_all_reduce_s_time_of_its_seed_and_rate(tmp_path: Path) -> None:
    settings = parse_args(["--data", str(tmp_path), "--methods", "allreduce", "--steps", "20"])
    jobs = run_order(["allreduce", "powersgd", "postlocal"], [1, 2], [1e-3, 2e-3])
    seconds = {(1, 1e-3): 30.0, (1, 2e-3): 31.0, (2, 2e-3): 33.0}  # DDP of seed 2 at 1e-3 fails
    asked: list[tuple[str, int, float, float | None]] = []
    done: list[int] = []

    def run_one(job: Job, run: Path, budget: float | None) -> dict[str, Any]:
        asked.append((job.method, job.seed, job.lr, budget))
        if job.method == "allreduce" and (job.seed, job.lr) not in seconds:
            return {"method": job.method, "seed": job.seed, "failed": "died", "wall_seconds": 1.0,
                    "curve": points((10, 12.0, 5.0))}  # fmt: skip
        end = seconds.get((job.seed, job.lr), 40.0)
        return {"method": job.method, "seed": job.seed, "wall_seconds": end,
                "curve": points((10, end / 2, 5.0), (20, end, 4.0))}  # fmt: skip

    trained: dict[str, dict[str, Any]] = {}
    cli.train_in_order(jobs, True, settings, run_one, done.append, trained)
    budgets = {(m, s, lr): b for m, s, lr, b in asked}
    assert all(budgets[("allreduce", s, lr)] is None for s in (1, 2) for lr in (1e-3, 2e-3))
    assert budgets[("powersgd", 1, 1e-3)] == 30.0 and budgets[("postlocal", 1, 2e-3)] == 31.0
    assert budgets[("powersgd", 2, 2e-3)] == 33.0
    assert budgets[("powersgd", 2, 1e-3)] is None  # its DDP failed: the others train its steps
    assert done == [1, 2] and len(trained) == 12 and trained["powersgd/lr=0.002/seed2"]["order"] == 10


def test_the_load_meter_samples_the_load_average_and_the_busy_share() -> None:
    with launch.LoadMeter(interval_s=0.05) as meter:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # keep one core busy
            pass
    result = meter.result
    assert result["loadavg_samples"] >= 4  # at the start, every 50 ms, at the end
    assert 0.0 < result["cpu_busy_share"] <= 1.0
    assert 0.0 <= result["loadavg_1min_mean"] <= result["loadavg_1min_max"]


def test_the_default_is_whatever_the_library_s_default_setting_is_at_run_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = methods.method_args("decentadam-default", None, 300)
    assert args[:2] == ["-m", methods.TRAIN] and "optim.setting=default" in args
    flat = SETTINGS["default"].flat()
    assert f"optim.topology={flat['topology']}" in args and f"optim.sync_steps={flat['sync_steps']}" in args
    changed = {**SETTINGS, "default": Setting(topology="ring", exchange="bf16_updates", average_every=8)}
    monkeypatch.setattr(methods, "SETTINGS", changed)
    args = methods.method_args("decentadam-default", None, 300)
    assert {"optim.topology=ring", "optim.exchange=bf16_updates", "optim.average_every=8"} <= set(args)
    # every option written out, so the preset file's own ones (topology = "aer", ...) change nothing
    from recipes.common.optim import resolved
    from recipes.translation import config

    cfg = config.load("multi30k-en-de", [a for a in args if "=" in a])
    assert resolved(cfg.optim).topology == "ring" and resolved(cfg.optim).average_every == 8


def test_each_method_s_module_and_arguments() -> None:
    assert methods.method_args("allreduce", None, 300) == ["-m", methods.TRAIN, "--optimizer", "allreduce"]
    powersgd = methods.method_args("powersgd", None, 300)
    assert powersgd == ["-m", methods.ALTERNATIVES, "powersgd", "--warmup=300", "--optimizer", "allreduce"]
    best = methods.method_args("decentadam-best", "nodes-complete-bf16", 300)
    assert "optim.setting=nodes-complete-bf16" in best and "optim.exchange=bf16_updates" in best
    with pytest.raises(ValueError, match="needs a setting's name"):
        methods.method_args("decentadam-best", None, 300)
    with pytest.raises(ValueError, match="unknown setting"):
        methods.setting_args("fastest")
    assert [m for m in methods.METHODS.values() if m.is_default] == [methods.METHODS["decentadam-default"]]
    assert "sync_steps=300" in methods.about("decentadam-best", "nodes-complete-bf16", 300)
    assert "rank 4" in methods.about("powersgd", None, 300)


# ------------------------------------------------------------------------------------ the report


def points(*values: tuple[int, float, float]) -> list[dict[str, float]]:
    return [{"step": s, "train_seconds": t, "valid_nll": v, "epoch": 0} for s, t, v in values]


def made_up_run(
    method: str, seed: int, curve: list[dict[str, float]], bleu: float, **extra: Any
) -> dict[str, Any]:
    return {
        "method": method,
        "seed": seed,
        "lr": 2e-3,
        "is_default": method == "decentadam-default",
        "label": methods.label(method),
        "steps": 30,
        "order": 0,
        "wall_seconds": curve[-1]["train_seconds"] + 30,
        "inter_node_bytes_per_step": 12.5e6,
        "load": {
            "cpu_busy_share": 0.97,
            "loadavg_1min_mean": 4.2,
            "loadavg_1min_max": 4.8,
            "loadavg_samples": 9,
        },
        "curve": curve,
        "bleu": bleu,
        "bleu_in_allreduce_time": bleu,
        "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
        **extra,
    }


def made_up_report() -> dict[str, Any]:
    runs = {
        # All-Reduce: 2 s per step, final valid NLL 3.0 (seed 1) and 3.1 (seed 2) at 60 s, step 30
        "allreduce/seed1": made_up_run(
            "allreduce", 1, points((10, 20.0, 5.0), (20, 40.0, 4.0), (30, 60.0, 3.0)), 30.0
        ),
        "allreduce/seed2": made_up_run(
            "allreduce", 2, points((10, 20.0, 5.1), (20, 40.0, 4.1), (30, 60.0, 3.1)), 29.0
        ),
        # the default: 1 s per step; seed 1 reaches 3.0 at step 25 (25 s), seed 2 reaches 3.1 at step 20
        "decentadam-default/seed1": made_up_run(
            "decentadam-default", 1, points((10, 10.0, 5.5), (20, 20.0, 3.5), (30, 30.0, 2.5)), 29.8
        ),
        "decentadam-default/seed2": made_up_run(
            "decentadam-default", 2, points((10, 10.0, 5.5), (20, 20.0, 3.1), (30, 30.0, 2.9)), 28.8
        ),
        # PowerSGD: as many steps as All-Reduce at 0.5 s per step: sooner than the default on seed 1
        "powersgd/seed1": made_up_run(
            "powersgd", 1, points((10, 5.0, 5.0), (20, 10.0, 4.0), (30, 15.0, 3.0)), 30.0
        ),
        "powersgd/seed2": made_up_run(
            "powersgd", 2, points((10, 5.0, 5.1), (20, 10.0, 4.1), (30, 15.0, 3.1)), 29.0
        ),
        # decent-dp never reaches the target
        "decent-dp/seed1": made_up_run(
            "decent-dp", 1, points((10, 8.0, 6.0), (20, 16.0, 5.0), (30, 24.0, 4.0)), 20.0
        ),
        "decent-dp/seed2": made_up_run(
            "decent-dp", 2, points((10, 8.0, 6.0), (20, 16.0, 5.0), (30, 24.0, 4.0)), 20.0
        ),
    }
    for order, run in enumerate(runs.values(), start=1):
        run["order"] = order
    return {
        "command": ".venv/bin/python -m benchmarks.time_to_quality --data D --steps 30 --best default",
        "preset": "multi30k-en-de",
        "data": "/data",
        "overrides": [],
        "steps": 30,
        "eval_every": 10,
        "seeds": [1, 2],
        "lrs": [2e-3],
        "best": "nodes-complete-bf16",
        "nodes": 2,
        "ranks_per_node": 2,
        "about": {
            name: methods.about(name, "nodes-complete-bf16", 300) for name in ("allreduce", "powersgd")
        },
        "calibration": {"compute_s": 1.0, "compute_mean_s": 0.9, "param_bytes": 30e6, "params": 7.5e6},
        "link": {"rate_mbit": 240.0, "how": "solved", "allreduce_comm_s": 1.5, "comm_ratio": 1.5},
        "model_inputs": {"inter_bytes_per_s": 28e6, "intra_bytes_per_s": 900e6},
        "machine": {"cpu": "test CPU", "cores": "2", "torch": "2.13", "date": "today"},
        "runs": runs,
    }


def test_report_json_schema_and_numbers_from_made_up_curves(tmp_path: Path) -> None:
    paths = reporting.write_report(made_up_report(), tmp_path)
    assert [p.name for p in paths] == ["time_to_quality.md", "time_to_quality.json", "time_to_quality.png"]
    assert_drawn(paths[2], (1320, 480))
    report = json.loads(paths[1].read_text())
    runs = report["runs"]
    for key, run in runs.items():  # the schema: keyed METHOD/seedN, each with these fields
        method, seed = key.split("/")
        assert (run["method"], f"seed{run['seed']}") == (method, seed)
        assert run["is_default"] is (method == "decentadam-default")
        assert all(set(p) >= {"step", "valid_nll", "train_seconds"} for p in run["curve"])
        assert isinstance(run["bleu"], float)
    seed1, seed2 = runs["decentadam-default/seed1"], runs["decentadam-default/seed2"]
    assert (seed1["target_valid_nll"], seed2["target_valid_nll"]) == (3.0, 3.1)  # each seed's own All-Reduce
    assert seed1["time_to_target_s"] == pytest.approx(25.0) and seed2["time_to_target_s"] == pytest.approx(
        20.0
    )
    assert seed1["steps_ratio"] == pytest.approx(25 / 30) and seed1["per_step_ratio"] == pytest.approx(0.5)
    assert seed1["time_ratio"] == pytest.approx(25 / 60)
    default = report["methods"]["decentadam-default"]
    assert default["time_to_target_s"] == {
        "mean": pytest.approx(22.5),
        "by_seed": [pytest.approx(25.0), 20.0],
    }
    assert default["time_ratio"]["mean"] == pytest.approx(22.5 / 60)
    assert default["bleu"]["mean"] == pytest.approx(29.3) and default["is_default"]
    assert report["methods"]["powersgd"]["time_to_target_s"]["mean"] == pytest.approx(15.0)
    assert report["methods"]["decent-dp"]["time_to_target_s"] == {"mean": None, "by_seed": [None, None]}
    assert report["methods"]["allreduce"]["inter_node_bytes_per_step"]["mean"] == 12.5e6

    goals = {g["goal"]: g for g in report["goals"]}
    assert goals[f"the default reaches DDP's final validation loss in <= {TTQ_DEFAULT_RATIO:g}x DDP's time "
                 "(mean of the seeds)"]["met"]  # fmt: skip
    powersgd = goals[f"the default reaches it sooner than {methods.label('powersgd')}"]
    assert not powersgd["met"] and powersgd["measured"] == "22 s vs 15 s"
    assert goals[f"the default reaches it sooner than {methods.label('decent-dp')}"]["met"]  # it never does
    bleu = goals["the default's BLEU within 0.5 of DDP's, in no more training time"]
    assert bleu["met"] and bleu["measured"] == "29.30 vs 29.50 (-0.20)"

    md = paths[0].read_text()
    assert report["command"] in md and "| 240 Mbit/s (solved) |" in md
    assert "| DecentralizedAdam, the library's default | 22 (25; 20) | 0.38 (0.42; 0.33) |" in md
    assert "| decent-dp 0.2.3 (AccumAdamW on AER) | not reached (not reached; not reached) |" in md
    assert "| 8 | `decent-dp/seed2` | 54 | 24 | 4.20 / 4.80 | 97% |" in md  # the order and the load
    assert "## Validation loss at each evaluation, seed 2" in md
    assert "- The default is not sooner than DDP + AdamW, PowerSGD rank 4: 22 s against 15 s" in md


def test_the_note_says_whether_steps_or_time_per_step_cost_the_default() -> None:
    report = curves.analyse(made_up_report())
    [note] = notes.slower_notes(report["methods"])
    # the default: steps ratio (25/30 + 20/30) / 2 = 0.75 against PowerSGD's 1.0; time per step 0.5 vs 0.25
    assert note.kind == "time per step" and "+8 s" in note.text and "0.75 against 1.00" in note.text
    slow = made_up_report()
    for seed in (1, 2):  # now the default needs all of All-Reduce's steps, at PowerSGD's time per step
        slow["runs"][f"decentadam-default/seed{seed}"]["curve"] = points(
            (10, 10.0, 5.5), (20, 20.0, 4.5), (40, 40.0, 2.9 + 0.1 * seed)
        )
    [note] = notes.slower_notes(curves.analyse(slow)["methods"])
    assert note.kind == "steps and time per step"
    never = made_up_report()
    for seed in (1, 2):
        never["runs"][f"decentadam-default/seed{seed}"]["curve"] = points((30, 30.0, 3.5))
    found = notes.slower_notes(curves.analyse(never)["methods"])
    assert [n.kind for n in found] == ["not reached", "not reached"]  # All-Reduce and PowerSGD reach it
    assert not curves.analyse(never)["goals"][0]["met"]


def test_a_rate_grid_reports_each_method_s_best_rate() -> None:
    report = made_up_report()
    grid = {}
    for key, run in report["runs"].items():
        method, seed = key.split("/")
        worse = dict(run, lr=1e-3, curve=[{**p, "valid_nll": p["valid_nll"] + 0.5} for p in run["curve"]])
        grid[f"{method}/lr=0.002/{seed}"] = run
        grid[f"{method}/lr=0.001/{seed}"] = worse
    report["grid"], report["runs"] = grid, {}
    curves.analyse(report)
    assert set(report["chosen_lr"].values()) == {2e-3} and len(report["runs"]) == 8
    assert report["runs"]["powersgd/seed1"] is grid["powersgd/lr=0.002/seed1"]
    assert "| 16 | `powersgd/lr=0.001/seed2` |" not in reporting.markdown(report)  # orders as trained


def test_bleu_in_all_reduce_s_time_scores_the_last_checkpoint_within_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def checkpoints(run: Path) -> list[Path]:
        return sorted((p for p in run.glob("step-*")), key=lambda p: int(p.name.split("-")[1]))

    def bleu(run: Path, settings: Any, test: Any) -> tuple[list[str], dict[str, Any]]:
        return ["eval.bleu", str(run)], {"bleu": float(checkpoints(run)[-1].name.split("-")[1])}

    monkeypatch.setattr(cli, "list_checkpoints", checkpoints)
    monkeypatch.setattr(cli, "_bleu", bleu)
    trained = {}
    for method, seconds in (
        ("allreduce", 20.0),
        ("powersgd", 30.0),
        ("postlocal", 10.0),
        ("decent-dp", 90.0),
    ):
        run = tmp_path / method
        for step in (10, 20, 30):
            (run / f"step-{step}").mkdir(parents=True)
        curve = points((10, seconds / 3, 5.0), (20, 2 * seconds / 3, 4.0), (30, seconds, 3.0))
        trained[method] = {"method": method, "seed": 1, "lr": 1e-3, "run_dir": str(run), "curve": curve}
    cli.score(trained, 1, parse_args(["--data", str(tmp_path), "--methods", "allreduce"]), {})
    assert trained["powersgd"]["bleu"] == 30.0 and trained["powersgd"]["bleu_in_allreduce_time"] == 20.0
    assert trained["postlocal"]["bleu_in_allreduce_time"] == 30.0  # done within All-Reduce's 20 s
    assert trained["decent-dp"]["bleu_in_allreduce_time"] is None  # its first evaluation came later
    assert [p.name for p in checkpoints(tmp_path / "powersgd")] == ["step-20", "step-30"]  # the rest deleted
    assert [p.name for p in checkpoints(tmp_path / "allreduce")] == ["step-30"]


def test_a_failed_training_is_reported_with_its_reason_and_is_no_target_and_wins_no_goal(
    tmp_path: Path,
) -> None:
    report = made_up_report()
    runs = report["runs"]
    runs["allreduce/seed2"]["curve"] = runs["allreduce/seed2"]["curve"][:1]  # died after step 10
    runs["allreduce/seed2"]["failed"] = "allreduce-seed2: a rank exited with code 1; its log (r1.log):\nOOM"
    del runs["allreduce/seed2"]["bleu"], runs["allreduce/seed2"]["bleu_in_allreduce_time"]
    runs["powersgd/seed1"]["failed"] = "powersgd-seed1: a rank hung past --timeout 30 s"
    report = json.loads(reporting.write_report(report, tmp_path)[1].read_text())
    assert report["runs"]["decentadam-default/seed2"]["target_valid_nll"] is None  # not DDP's final loss
    assert report["runs"]["decentadam-default/seed1"]["target_valid_nll"] == 3.0
    assert report["methods"]["allreduce"]["failed_seeds"] == [2]
    assert report["methods"]["decentadam-default"]["failed_seeds"] == []
    goals = {g["goal"]: g for g in report["goals"]}
    powersgd = goals[f"the default reaches it sooner than {methods.label('powersgd')}"]
    assert not powersgd["met"] and powersgd["measured"].endswith("(a training failed)")
    md = (tmp_path / "time_to_quality.md").read_text()
    assert "## Failed trainings" in md
    assert (
        "- `allreduce/seed2`: last evaluation at step 10 of 30; allreduce-seed2: a rank exited with code 1; "
        "its log (r1.log):" in md
    )
    assert "- `powersgd/seed1`: last evaluation at step 30 of 30; powersgd-seed1: a rank hung" in md
    assert "| DDP + AdamW (float32) (FAILED: seed 2) | not reached (60; not reached) |" in md  # no target
    assert "| 2 | `allreduce/seed2` (failed) |" in md


def test_a_training_that_fails_returns_its_reason_and_is_not_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Cluster:
        def link_bytes(self) -> list[tuple[int, int]]:
            return [(0, 0), (0, 0)]

    def run_all(commands: Any, timeout_s: float, what: str, echo: bool = False) -> None:
        raise RuntimeError(
            f"{what}: a rank exited with code 1; its log (x.log):\nTraceback ...\nValueError: nan"
        )

    monkeypatch.setattr(launch, "rank_commands", lambda *args: [])
    monkeypatch.setattr(launch, "run_all", run_all)
    settings = parse_args(["--data", str(tmp_path), "--methods", "allreduce", "--steps", "30"])
    result = launch.train(
        Cluster(), Job("powersgd", 2, 1e-3), settings, tmp_path / "powersgd-seed2", tmp_path, 5
    )
    assert (
        result["failed"].startswith("powersgd-seed2: a rank exited with code 1")
        and "ValueError: nan" in result["failed"]
    )
    assert (result["method"], result["seed"], result["steps"]) == ("powersgd", 2, 30)

    scored: list[str] = []

    def bleu(run: Path, *_: Any) -> tuple[list[str], dict[str, Any]]:
        scored.append(run.name)
        return ["eval.bleu", str(run)], {"bleu": 1.0}

    monkeypatch.setattr(cli, "_bleu", bleu)
    monkeypatch.setattr(cli, "list_checkpoints", lambda run: [])
    curve = points((10, 5.0, 5.0))
    trained = {
        "allreduce/seed2": {"method": "allreduce", "seed": 2, "lr": 1e-3, "run_dir": str(tmp_path / "a"),
                            "curve": curve, "failed": "died"},
        "powersgd/seed2": {"method": "powersgd", "seed": 2, "lr": 1e-3, "run_dir": str(tmp_path / "p"),
                           "curve": curve},
    }  # fmt: skip
    cli.score(trained, 2, settings, {})
    assert scored == ["p"] and "bleu" not in trained["allreduce/seed2"]
    assert trained["powersgd/seed2"]["bleu_in_allreduce_time"] == 1.0  # DDP failed: its final checkpoint's


def test_render_writes_the_report_again_from_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    reporting.write_report(made_up_report(), first)
    again = tmp_path / "again"
    assert cli.main(["--render", str(first / "time_to_quality.json"), "--out-dir", str(again)]) == 0
    assert (again / "time_to_quality.md").read_text() == (first / "time_to_quality.md").read_text()
    broken = tmp_path / "broken.json"
    broken.write_text('{"runs": ')
    with pytest.raises(SystemExit):
        cli.main(["--render", str(broken)])
    assert "cannot read the run's JSON" in capsys.readouterr().err
    broken.write_text(json.dumps({"runs": {"aer": {"curve": []}}}))
    with pytest.raises(SystemExit):
        cli.main(["--render", str(broken)])
    assert "earlier one-seed format" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--steps", "100", "--max-steps", "50"], "--max-steps 50 is below --steps 100"),
        (["--eval-every", "0"], "--eval-every must be at least 1"),
        (["--methods", "allreduce,aer"], "expected distinct names of allreduce, allreduce-bf16"),
        (["--methods", "powersgd"], "every comparison is to allreduce"),
        (["--methods", "allreduce,decentadam-best"], "decentadam-best needs --best NAME"),
        (["--seeds", "1,1"], "expected distinct integers"),
        (["--seeds", "one"], "expected comma-separated numbers"),
        (["--lr-grid", "1e-3,-1"], "expected distinct rates > 0"),
        (["--link-mbit", "-5"], "--link-mbit must be > 0"),
        (["optim.accum_steps"], "is not KEY=VALUE"),
        (["train.seed=5"], "the benchmark sets that itself"),
        (["optim.lr=1e-3"], "the benchmark sets that itself"),
        (["optim.second_moment=local"], "the benchmark sets that itself"),
        (["data=/elsewhere"], "the benchmark sets that itself"),
    ],
)
def test_argument_errors(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    best = [] if "--best NAME" in message else ["--best", "default"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--data", str(tmp_path), *best, *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_settings_defaults_and_what_every_training_gets(tmp_path: Path) -> None:
    settings = parse_args(["--data", str(tmp_path), "--best", "nodes-complete-bf16", "model.dropout=0.2"])
    assert settings.methods == tuple(methods.METHODS) and settings.seeds == (1, 2) and settings.lrs == ()
    assert settings.steps == 1200 and settings.eval_every == 100 and settings.link_mbit is None
    assert settings.recipe_overrides() == [f"data={tmp_path}", "train.log_every=100", "model.dropout=0.2"]
    run = settings.run_settings(seed=2, lr=None)
    assert {"train.seed=2", "train.save_every=100", "train.keep_last=0", "train.max_minutes=0"} <= set(run)
    assert "train.max_steps=1200" in run
    # a method after All-Reduce trains for its time, at most 3 x its steps (or --max-steps)
    timed = settings.run_settings(seed=2, lr=None, budget_s=90.0)
    assert {"train.max_minutes=1.5", "train.max_steps=3600", "train.seed=2"} <= set(timed)
    capped = parse_args(["--data", str(tmp_path), "--methods", "allreduce", "--max-steps", "2000"])
    assert "train.max_steps=2000" in capped.run_settings(seed=1, lr=None, budget_s=90.0)
    assert not any(item.startswith("optim.lr") for item in run)
    assert "optim.lr=0.001" in settings.run_settings(seed=1, lr=1e-3)
    assert parse_args(["--data", str(tmp_path), "--lr-grid", "1e-3,2e-3", "--methods", "allreduce"]).lrs == (
        1e-3,
        2e-3,
    )


def test_decent_dp_comes_from_the_bench_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = parse_args(["--data", str(tmp_path), "--methods", "allreduce,decent-dp"])
    monkeypatch.setitem(sys.modules, "decent_dp", None)  # as if it were not installed
    assert "pip install -e '.[bench]'" in (cli.missing_decent_dp(settings) or "")
    assert cli.missing_decent_dp(parse_args(["--data", str(tmp_path), "--methods", "allreduce"])) is None


# ------------------------------------------------------------------------------------ end to end

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip, tc) to create the emulated cluster's network namespaces",
)


# slow: the whole benchmark end to end (calibration, every method x 2 seeds in the emulated cluster,
# BLEU, the report): 14 trainings of 4 processes, several minutes on 2 cores. The default suite keeps
# its parts: the report, order, load and arguments above, each method's steps in
# tests/test_time_to_quality_alternatives.py, the cluster in tests/test_cluster_netns.py, the recipe's
# training and eval.bleu in tests/test_translation_e2e.py. `make test-slow` (CI) runs it.
@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(1500)
def test_the_command_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")
    from recipes.translation import synthetic

    every = list(methods.METHODS)
    if importlib.util.find_spec("decent_dp") is None:  # without the bench extra, the rest still runs
        every.remove("decent-dp")
    corpus = synthetic.write(tmp_path / "corpus", train=600, val=40, test=12)
    prefix = f"dq{os.getpid() % 100000}"
    command = [
        sys.executable, "-m", "benchmarks.time_to_quality", "--data", str(corpus),
        "--preset", "demo-synthetic-en-de", "--steps", "4", "--eval-every", "2", "--seeds", "1,2",
        "--methods", ",".join(every), "--best", "nodes-complete-bf16",
        "--calibration-warmup", "1", "--calibration-steps", "2",
        "--work-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"), "--prefix", prefix,
        "--bleu-arg=--max-len-b=5",
        f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200", "model.layers=1",
        "model.d_model=32", "model.ffn_dim=64", "model.heads=2", "train.global_tokens=1024",
        "data.val_limit=40", "optim.warmup_steps=2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # run from the repository root: -m finds the packages
    process = subprocess.run(command, capture_output=True, text=True, timeout=1400, env=env, cwd=ROOT)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [line for line in listing.splitlines() if line.startswith(f"{prefix}-")]
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    assert "node link rate:" in process.stdout and "Mbit/s (solved" in process.stdout

    report = json.loads((tmp_path / "out" / "time_to_quality.json").read_text())
    assert sorted(report["runs"]) == sorted(f"{m}/seed{s}" for m in every for s in (1, 2))
    assert [run["order"] for run in report["runs"].values()] == list(range(1, 2 * len(every) + 1))
    keys = list(report["runs"])
    assert keys[0] == "allreduce/seed1" and keys[len(every)] == "allreduce/seed2"
    for key, run in report["runs"].items():
        steps = [p["step"] for p in run["curve"]]
        if run["method"] == "allreduce":
            assert steps == [2, 4] and run["budget_s"] is None
        else:  # DDP's time of its seed (any rank's clock: out_of_time), at most 3 x 4 steps
            ddp = report["runs"][f"allreduce/seed{run['seed']}"]["curve"][-1]["train_seconds"]
            assert run["budget_s"] == ddp and steps == list(range(2, steps[-1] + 1, 2)), key
            assert f"train.max_minutes={ddp / 60:.6g}" in run["train_command"], key
            assert "train.max_steps=12" in run["train_command"] and run["steps"] == steps[-1], key
        assert run["bleu_signature"].startswith("nrefs:1|case:mixed|")
        assert run["inter_node_bytes_per_step"] > 0  # the ranks talked through the shaped links
        assert run["load"]["loadavg_samples"] >= 2 and 0 < run["load"]["cpu_busy_share"] <= 1
    assert report["runs"]["allreduce/seed1"]["time_to_target_s"] is not None
    assert report["runs"]["decentadam-default/seed1"]["is_default"]
    assert set(report["methods"]) == set(every) and report["goals"]
    md = (tmp_path / "out" / "time_to_quality.md").read_text()
    assert "-m benchmarks.time_to_quality --data" in md and "## Goals (the library's default)" in md
