"""benchmarks.time_to_quality: the link-rate solver, the report on made-up runs, which note the numbers
choose, argument errors, and (as root, with ``ip netns``) the whole command on a tiny model and corpus."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib (pip install '.[bench]')")

from benchmarks.thresholds import GOSSIP_SHARE, MODEL_MISSED, WAIT_SHARE
from benchmarks.time_to_quality import cli, curves, notes, rates
from benchmarks.time_to_quality import report as reporting
from benchmarks.time_to_quality.methods import METHODS
from benchmarks.time_to_quality.settings import parse_args
from decentadam.runtime_model import Cluster
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


# ------------------------------------------------------------------------------------ the report


def points(*values: tuple[int, float, float]) -> list[dict[str, float]]:
    return [{"step": s, "train_seconds": t, "valid_nll": v, "epoch": 0} for s, t, v in values]


def test_time_to_target_interpolates_and_says_when_never() -> None:
    curve = points((10, 10.0, 5.0), (20, 20.0, 4.0), (30, 30.0, 3.0))
    assert curves.time_to_reach(curve, 3.5) == pytest.approx(25.0)
    assert curves.time_to_reach(curve, 4.0) == pytest.approx(20.0)
    assert curves.time_to_reach(curve, 6.0) == pytest.approx(10.0)  # already there at the first point
    assert curves.time_to_reach(curve, 2.9) is None
    assert curves.time_to_reach([], 1.0) is None
    # the first interval (warm-up) is left out of ms per iteration
    assert curves.steady_ms_per_iter(points((10, 15.0, 5.0), (20, 25.0, 4.0), (30, 35.0, 3.0))) == 1000.0
    assert curves.steady_ms_per_iter(points((10, 15.0, 5.0))) == 1500.0
    assert curves.steady_ms_per_iter([]) is None


def made_up_report() -> dict[str, Any]:
    def run(curve: list[dict[str, float]], bleu: float, predicted_ms: float) -> dict[str, Any]:
        return {
            "label": "x",
            "train_command": "python train.py",
            "wall_seconds": curve[-1]["train_seconds"] + 30,
            "link_mb_per_rank_iter": 12.5,
            "curve": curve,
            "bleu": bleu,
            "chrf": 50.0,
            "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
            "predicted": {
                "iteration_ms": predicted_ms,
                "serial_ms": predicted_ms + 100,
                "lower_bound_ms": predicted_ms - 50,
                "comm_ms": 1500.0 if predicted_ms > 2000 else 500.0,
                "inter_mb": 10.0,
            },
        }

    return {
        "command": ".venv/bin/python -m benchmarks.time_to_quality --data D --steps 30",
        "preset": "multi30k-en-de",
        "data": "/data",
        "overrides": ["optim.accum_steps=2"],
        "steps": 30,
        "eval_every": 10,
        "calibration": {
            "compute_s": 1.0,
            "compute_mean_s": 0.9,
            "forward_fraction": 0.33,
            "adamw_s": 0.03,
            "decentralized_s": 0.04,
            "param_bytes": 30e6,
            "params": 7.5e6,
        },
        "link": {"rate_mbit": 240.0, "how": "solved", "allreduce_comm_s": 1.5, "comm_ratio": 1.5},
        "model_inputs": {"inter_bytes_per_s": 28e6, "intra_bytes_per_s": 900e6},
        "machine": {"cpu": "test CPU", "cores": "2", "torch": "2.13", "date": "today"},
        "runs": {
            # All-Reduce: 2 s per step after the first interval, final valid NLL 3.0 at 60 s
            "allreduce": run(points((10, 20.0, 5.0), (20, 40.0, 4.0), (30, 60.0, 3.0)), 30.0, 2200.0),
            # AER: 1 s per step, reaches 3.0 between 20 s (3.5) and 30 s (2.5): at 25 s
            "aer": run(points((10, 10.0, 5.5), (20, 20.0, 3.5), (30, 30.0, 2.5)), 29.8, 1050.0),
            "complete": run(points((10, 11.0, 5.5), (20, 22.0, 4.5), (30, 33.0, 3.2)), 29.0, 1100.0),
        },
    }


def test_report_from_made_up_runs(tmp_path: Path) -> None:
    paths = reporting.write_report(made_up_report(), tmp_path)
    assert [p.name for p in paths] == ["time_to_quality.md", "time_to_quality.json", "time_to_quality.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert_drawn(paths[2], (1320, 480))  # the 11 x 4 inch figure at 120 dpi, curves drawn
    report = json.loads(paths[1].read_text())
    runs = report["runs"]
    assert report["target_valid_nll"] == 3.0
    assert runs["allreduce"]["time_to_target_s"] == pytest.approx(60.0)
    assert runs["aer"]["time_to_target_s"] == pytest.approx(25.0)
    assert runs["aer"]["time_ratio"] == pytest.approx(25.0 / 60.0)
    assert runs["complete"]["time_to_target_s"] is None
    assert runs["aer"]["ms_per_iter"] == pytest.approx(1000.0)
    assert runs["aer"]["iter_ratio"] == pytest.approx(0.5)
    assert runs["aer"]["predicted_iter_ratio"] == pytest.approx(1050.0 / 2200.0)
    goals = {g["goal"].split()[-1]: g for g in report["goals"]}
    assert len(report["goals"]) == 3 and all(g["met"] for g in report["goals"]), goals

    md = paths[0].read_text()
    assert report["command"] in md
    assert "| AccumAdam-complete |" in md and "not reached" in md
    assert "| AccumAdam-AER | 60 | 30 | 1000 | 1050 / 1150 | 0.50 / 0.48 |" in md
    assert "| 25 | 0.42 | 2.500 | 29.80 |" in md
    assert "Signature: `BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`." in md
    assert "| 240 Mbit/s (solved) |" in md
    assert (
        "| All-Reduce communication per iteration with the probed B_inter (model) | 1607 ms = 1.61 x C |"
        in md
    )
    assert "| 20 | 4.000 (40) | 3.500 (20) | 4.500 (22) |" in md  # the curves, step by step

    # time to each of All-Reduce's losses: AER reaches 5.0 a quarter of the way from step 10 to 20
    first = report["levels"][0]
    assert (first["step"], first["valid_nll"]) == (10, 5.0)
    aer = first["methods"]["aer"]
    assert (aer["seconds"], aer["steps"]) == pytest.approx((12.5, 12.5))
    assert (aer["time_ratio"], aer["steps_ratio"]) == pytest.approx((12.5 / 20, 1.25))
    assert report["levels"][1]["methods"]["complete"]["steps"] == pytest.approx(20 + 10 * 0.5 / 1.3)
    assert report["levels"][2]["methods"]["complete"]["seconds"] is None
    assert "| 10 | 5.000 | 20 | 12 (12) | 0.62 = 1.25 x 0.50 |" in md
    assert "did not reach" not in md


def test_every_method_on_aers_graph_is_judged_and_bleu_only_in_all_reduces_time() -> None:
    report = made_up_report()
    node = dict(report["runs"]["aer"])
    # reaches 3.0 at 35 s (0.58x All-Reduce's 60 s); its BLEU is All-Reduce's, after 70 s of training
    node["curve"] = points((10, 14.0, 5.5), (20, 28.0, 3.2), (40, 70.0, 2.0))
    node["bleu"] = 30.0
    report["runs"]["aer-node"] = node
    curves.analyse(report)
    label = METHODS["aer-node"].label
    by_goal = {g["goal"]: g for g in report["goals"]}
    assert len(report["goals"]) == 6  # three for aer, three for aer-node; none for complete
    report["runs"]["complete-node-bf16"] = dict(node)
    assert len(curves.goals(report["runs"])) == 9  # and three for the nodes on complete at aer's bytes
    reached = by_goal[f"{label}: reaches All-Reduce's final validation loss in <= 0.6x its time"]
    assert reached["met"] and reached["measured"] == "0.58x"
    bleu = by_goal[f"{label}: BLEU within 0.5 of All-Reduce's in no more training time"]
    assert not bleu["met"] and bleu["measured"] == "30.00 vs 30.00 (+0.00) after 1.17x its training time"
    report["runs"]["aer-node"]["curve"][-1]["train_seconds"] = 60.0  # the same BLEU in All-Reduce's time
    curves.analyse(report)
    assert {g["goal"]: g["met"] for g in report["goals"]}[bleu["goal"]]


def test_all_reduce_alone_reports_without_a_comparison(tmp_path: Path) -> None:
    """A run of All-Reduce alone (the --baseline of later runs): no goals, no table of levels."""
    report = made_up_report()
    report["runs"] = {"allreduce": report["runs"]["allreduce"]}
    report["overrides"] = []
    md = reporting.write_report(report, tmp_path)[0].read_text()
    assert "with no overrides, 30 steps per method" in md
    assert "## Goals" not in md and "## Time to each of All-Reduce's validation losses" not in md
    assert "|  |" not in md


def test_comm_wait_from_the_runs_tensorboard_logs(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "aer" / "tb"))
    for step, value in ((50, 400.0), (100, 500.0), (150, 600.0)):
        writer.add_scalar("decentadam/comm_wait_ms", value, step)
        writer.add_scalar("train/loss", 1.0, step)
    writer.close()
    assert curves.comm_wait_ms(tmp_path / "aer") == pytest.approx(500.0)
    writer = SummaryWriter(str(tmp_path / "allreduce" / "tb"))
    writer.add_scalar("train/loss", 1.0, 50)
    writer.close()
    assert curves.comm_wait_ms(tmp_path / "allreduce") is None
    assert curves.comm_wait_ms(tmp_path / "nowhere") is None


def test_the_overlap_note_needs_a_fast_model_a_hidden_exchange_and_long_waits() -> None:
    runs = curves.analyse(made_up_report())["runs"]  # C = 1000 ms; AER: 1000 ms per iteration
    compute_ms, wait = 1000.0, WAIT_SHARE * 1000.0
    aer = runs["aer"]
    aer["predicted"] |= {"iteration_ms": (1 - MODEL_MISSED) * 1000.0 - 1, "comm_ms": 500.0}
    aer["comm_wait_ms"] = wait + 1
    assert notes.overlap_missed(aer, compute_ms)
    # each condition alone decides
    assert not notes.overlap_missed({**aer, "comm_wait_ms": wait}, compute_ms)  # short waits
    assert not notes.overlap_missed({**aer, "comm_wait_ms": None}, compute_ms)  # no exchanges
    close = {**aer["predicted"], "iteration_ms": (1 - MODEL_MISSED) * 1000.0 + 1}
    assert not notes.overlap_missed({**aer, "predicted": close}, compute_ms)  # the model is close
    exposed = {**aer["predicted"], "comm_ms": compute_ms + 1}
    assert not notes.overlap_missed({**aer, "predicted": exposed}, compute_ms)  # exchange not hidden

    runs["complete"]["comm_wait_ms"] = 150.0  # predicted within 10% of its 1100 ms: nothing missed
    found = notes.model_notes(runs, compute_ms)
    assert [note.kind for note in found] == ["model", "model, overlap missed", "model"]
    assert "blocked 101 ms per step" in found[1].text and "(-10%)" in found[1].text
    assert "blocked 150 ms per step" in found[2].text


def test_when_aer_misses_the_notes_say_how_far_it_got_and_why() -> None:
    report = made_up_report()
    report["runs"]["aer"]["curve"] = points((10, 10.0, 5.5), (20, 20.0, 4.5), (30, 30.0, 3.1))
    report["runs"]["aer"]["bleu"] = 29.0
    curves.analyse(report)
    assert [g["met"] for g in report["goals"]] == [False, False, True]
    assert report["goals"][0]["measured"] == "not reached"
    found = notes.miss_notes(report, compute_ms=1000.0)
    # AER took 0.50 x All-Reduce's time per iteration; complete (5.5, 4.5, 3.2) is never below AER
    assert [note.kind for note in found] == [
        "missed, faster per iteration",
        "not the gossip's",
        "last level reached",
    ]
    assert "(3.000) in 30 steps: it ended at 3.100" in found[0].text and "0.50 x" in found[0].text
    # the last of All-Reduce's losses AER reached: 4.000 (All-Reduce's step 20), a 0.5 / 1.4 of the way
    # from AER's step 20 to 30 = 1.18 x the steps, each at 0.50 x All-Reduce's time per step
    level = report["levels"][1]["methods"]["aer"]
    steps = 20 + 10 * 0.5 / 1.4
    assert (level["steps"], level["steps_ratio"], level["time_ratio"]) == pytest.approx(
        (steps, steps / 20, steps / 40)
    )
    assert "1.18 (steps) x 0.50 (time per step)" in found[2].text
    md = reporting.markdown(report)
    assert all(f"- {note.text}" in md for note in found)
    assert "| 30 | 3.000 | 60 | not reached | - |" in md

    report["runs"]["aer"]["curve"] = points((10, 25.0, 5.5), (20, 50.0, 4.5), (30, 75.0, 3.1))
    curves.analyse(report)  # now 2.5 s per step: slower than All-Reduce's 2 s
    assert notes.miss_notes(report, 1000.0)[0].kind == "missed, not faster per iteration"

    lines = reporting.summary(report).splitlines()
    assert lines[0].startswith(
        "All-Reduce (DDP + AdamW)   2000 ms/iter (predicted 2200), time to target 60 s"
    )
    assert (
        "AccumAdam-AER" in lines[1] and "time to target not reached, valid nll 3.100, BLEU 29.00" in lines[1]
    )


def runs_of(base: list[float], aer: list[float], complete: list[float]) -> dict[str, dict[str, Any]]:
    """All-Reduce, AER and complete with these validation losses at steps 10, 20, 30."""

    def curve(nll: list[float]) -> dict[str, Any]:
        return {"curve": points(*((10 * (i + 1), 10.0 * (i + 1), v) for i, v in enumerate(nll)))}

    return {"allreduce": curve(base), "aer": curve(aer), "complete": curve(complete)}


def test_the_topology_note_says_whose_the_distance_is_from_the_curves() -> None:
    base, aer = [5.0, 4.0, 3.0], [5.5, 4.5, 3.1]  # AER behind by 0.5, 0.5, 0.1: 1.1 in all
    # complete on AER's curve: none of the distance is the gossip's
    gap = notes.topology_gap(runs_of(base, aer, [5.5, 4.45, 3.1]))
    assert gap is not None and gap.steps == (10, 20, 30)
    assert gap.gossip == pytest.approx((0.0, 0.05, 0.0)) and gap.behind == pytest.approx((0.5, 0.5, 0.1))
    assert gap.share == pytest.approx(0.05 / 1.1) and not gap.is_gossips
    note = notes.topology_note(gap)
    assert note.kind == "not the gossip's" and "0.050" in note.text and "5%" in note.text

    # complete close to All-Reduce: most of AER's distance is the gossip's
    gap = notes.topology_gap(runs_of(base, aer, [5.1, 4.1, 3.02]))
    assert gap is not None and gap.share == pytest.approx((0.4 + 0.4 + 0.08) / 1.1) and gap.is_gossips
    assert notes.topology_note(gap).kind == "gossip"

    # the threshold decides, on either side of it
    for factor, gossips in ((0.99, False), (1.01, True)):
        complete = [a - factor * GOSSIP_SHARE * (a - b) for a, b in zip(aer, base, strict=True)]
        gap = notes.topology_gap(runs_of(base, aer, complete))
        assert gap is not None and gap.share == pytest.approx(factor * GOSSIP_SHARE)
        assert gap.is_gossips is gossips

    # AER never behind All-Reduce: no distance to explain
    gap = notes.topology_gap(runs_of(base, [4.9, 3.9, 3.0], [4.9, 3.9, 3.0]))
    assert gap is not None and gap.share is None and not gap.is_gossips
    assert notes.topology_note(gap).kind == "not behind"
    # without complete or a common evaluation there is nothing to compare
    assert notes.topology_gap({k: v for k, v in runs_of(base, aer, aer).items() if k != "complete"}) is None
    runs = runs_of(base, aer, aer)
    runs["complete"]["curve"] = points((15, 15.0, 4.0))
    assert notes.topology_gap(runs) is None


def test_the_committed_report_s_topology_note_holds_for_its_numbers() -> None:
    committed = json.loads((ROOT / "benchmarks" / "results" / "time_to_quality.json").read_text())
    gap = notes.topology_gap(committed["runs"])
    assert gap is not None and len(gap.steps) == 12
    assert max(abs(g) for g in gap.gossip) == pytest.approx(0.045, abs=5e-4)  # as the report states
    assert gap.share is not None and gap.share < GOSSIP_SHARE / 4
    assert notes.topology_note(gap).kind == "not the gossip's"


def test_render_writes_the_report_again_from_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    reporting.write_report(made_up_report(), first)
    again = tmp_path / "again"
    assert cli.main(["--render", str(first / "time_to_quality.json"), "--out-dir", str(again)]) == 0
    assert (again / "time_to_quality.md").read_text() == (first / "time_to_quality.md").read_text()
    assert (again / "time_to_quality.png").stat().st_size > 0
    broken = tmp_path / "broken.json"
    broken.write_text('{"runs": ')
    with pytest.raises(SystemExit):
        cli.main(["--render", str(broken)])
    assert "cannot read the run's JSON" in capsys.readouterr().err
    broken.write_text("[]")
    with pytest.raises(SystemExit):
        cli.main(["--render", str(broken)])
    assert "not a time_to_quality.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--eval-every", "0"], "--eval-every must be at least 1"),
        (["--methods", "allreduce,ring"], "expected distinct names of allreduce, aer, complete"),
        (["--methods", "aer,aer"], "expected distinct names"),
        (["--link-mbit", "-5"], "--link-mbit must be > 0"),
        (["--comm-ratio", "0"], "--comm-ratio must be > 0"),
        (["optim.accum_steps"], "is not KEY=VALUE"),
        (["train.max_steps=5"], "the benchmark sets that itself"),
        (["max_steps=5"], "the benchmark sets that itself"),
        (["data=/elsewhere"], "the benchmark sets that itself"),
        (["optim.topology=ring"], "the benchmark sets that itself"),
    ],
)
def test_argument_errors(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--data", str(tmp_path), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_data_and_busy_work_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--data", str(tmp_path / "nowhere")])
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "old").write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--data", str(tmp_path), "--work-dir", str(tmp_path / "work")])
    assert "is not empty" in capsys.readouterr().err


def test_settings_defaults_and_what_every_training_gets(tmp_path: Path) -> None:
    settings = parse_args(["--data", str(tmp_path), "--steps", "300", "optim.accum_steps=2"])
    assert settings.methods == ("allreduce", "aer", "complete")
    assert settings.eval_every == 30 and settings.link_mbit is None and settings.comm_ratio == 1.5
    assert settings.recipe_overrides() == [f"data={tmp_path}", "train.log_every=30", "optim.accum_steps=2"]
    assert "train.max_steps=300" in settings.run_settings()
    assert "train.max_minutes=0" in settings.run_settings()
    assert "optim.local_world_size=2" in settings.run_settings()


def test_baseline_from_an_earlier_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    earlier = made_up_report()
    earlier["runs"]["allreduce"]["steps"] = 30
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    args = ["--data", str(tmp_path), "--baseline", str(path), "optim.accum_steps=2"]
    settings = parse_args([*args, "--steps", "60"])
    assert settings.methods == ("aer", "complete") and settings.baseline is not None
    assert settings.baseline["from"] == str(path) and settings.baseline["steps"] == 30
    assert settings.baseline["curve"] == earlier["runs"]["allreduce"]["curve"]
    assert settings.link_mbit == 240.0  # the earlier run's rate
    assert settings.link_how == f"the rate of --baseline {path}"
    assert parse_args([*args, "--link-mbit", "100"]).link_how == "--link-mbit"

    def error(extra: list[str]) -> str:
        with pytest.raises(SystemExit):
            parse_args([*args, *extra])
        return capsys.readouterr().err

    assert "leave allreduce out of --methods" in error(["--methods", "allreduce,aer"])
    assert "give the same ones to compare" in error(["optim.lr=2e-3"])
    assert "give the same ones to compare" in error(["--preset", "multi30k-en-fr"])
    del earlier["runs"]["allreduce"]
    path.write_text(json.dumps(earlier))
    assert "no allreduce run with a validation curve" in error([])
    path.write_text("{")
    assert "cannot read it" in error([])

    # the report says where All-Reduce's run came from
    report = made_up_report()
    report["runs"]["allreduce"].update(steps=30, **{"from": "old/time_to_quality.json", "command": "C"})
    report["runs"]["aer"]["steps"] = 30
    [note] = notes.baseline_note(report)
    assert note.kind == "baseline" and "(30 steps," in note.text
    assert "`old/time_to_quality.json`, made by `C`" in note.text
    assert note.text in reporting.markdown(curves.analyse(report))
    assert notes.baseline_note(made_up_report()) == []  # trained in this run: nothing to say


# ------------------------------------------------------------------------------------ end to end

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip, tc) to create the emulated cluster's network namespaces",
)


# slow: the whole benchmark end to end (calibration, three trainings in the emulated cluster, BLEU,
# the report), about 90 s on 2 cores. The default suite keeps its parts: the report, notes and
# arguments above, the cluster in tests/test_cluster_netns.py, the recipe's training and eval.bleu in
# tests/test_translation_e2e.py. `make test-slow` (CI) runs it.
@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(400)
def test_the_command_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")
    from recipes.translation import synthetic

    corpus = synthetic.write(tmp_path / "corpus", train=600, val=40, test=12)
    prefix = f"dq{os.getpid() % 100000}"
    command = [
        sys.executable, "-m", "benchmarks.time_to_quality", "--data", str(corpus),
        "--preset", "demo-synthetic-en-de", "--steps", "4", "--eval-every", "2",
        "--methods", "allreduce,aer", "--calibration-warmup", "1", "--calibration-steps", "2",
        "--work-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"), "--prefix", prefix,
        "--bleu-arg=--max-len-b=5",
        f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200", "model.layers=1",
        "model.d_model=32", "model.ffn_dim=64", "model.heads=2", "train.global_tokens=1024",
        "data.val_limit=40",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # run from the repository root: -m finds the packages
    process = subprocess.run(command, capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [line for line in listing.splitlines() if line.startswith(f"{prefix}-")]
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    assert "node link rate:" in process.stdout and "Mbit/s (solved" in process.stdout

    report = json.loads((tmp_path / "out" / "time_to_quality.json").read_text())
    assert list(report["runs"]) == ["allreduce", "aer"]
    for run in report["runs"].values():
        assert [p["step"] for p in run["curve"]] == [2, 4]
        assert run["bleu_signature"].startswith("nrefs:1|case:mixed|")
        assert run["link_mb_per_rank_iter"] > 0  # the ranks talked through the shaped links
        assert run["predicted"]["iteration_ms"] > 0
    assert report["runs"]["allreduce"]["time_to_target_s"] is not None
    assert report["runs"]["allreduce"]["comm_wait_ms"] is None  # DDP: no exchanges of its own
    assert report["runs"]["aer"]["comm_wait_ms"] >= 0
    assert report["calibration"]["param_bytes"] > 0 and report["calibration"]["compute_s"] > 0
    md = (tmp_path / "out" / "time_to_quality.md").read_text()
    assert "-m benchmarks.time_to_quality --data" in md and "| AccumAdam-AER |" in md
    assert (tmp_path / "out" / "time_to_quality.png").stat().st_size > 0

    # AER for more steps against that All-Reduce run (--baseline): not trained again, same link rate
    again = list(command)
    again[again.index("--steps") + 1] = "6"
    again[again.index("--work-dir") + 1] = str(tmp_path / "runs2")
    again[again.index("--out-dir") + 1] = str(tmp_path / "out2")
    again[again.index("--methods") + 1] = "aer"
    again += ["--baseline", str(tmp_path / "out" / "time_to_quality.json")]
    process = subprocess.run(again, capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    assert "(the rate of --baseline" in process.stdout
    longer = json.loads((tmp_path / "out2" / "time_to_quality.json").read_text())
    assert list(longer["runs"]) == ["allreduce", "aer"]
    assert longer["link"]["rate_mbit"] == report["link"]["rate_mbit"]
    assert longer["runs"]["allreduce"]["from"] == str(tmp_path / "out" / "time_to_quality.json")
    assert longer["runs"]["allreduce"]["curve"] == report["runs"]["allreduce"]["curve"]
    aer, earlier = longer["runs"]["aer"], report["runs"]["aer"]
    assert [p["step"] for p in aer["curve"]] == [2, 4, 6] and aer["steps"] == 6
    # same seed and data order: the first 4 steps are the earlier run's
    assert [p["valid_nll"] for p in aer["curve"][:2]] == pytest.approx(
        [p["valid_nll"] for p in earlier["curve"]], rel=1e-5
    )
    assert "All-Reduce was not trained in this run" in (tmp_path / "out2" / "time_to_quality.md").read_text()


def test_the_node_averaged_method_asks_the_runtime_model_for_its_node_sums(tmp_path: Path) -> None:
    calibration = {"param_bytes": 30e6, "compute_s": 1.0, "forward_fraction": 0.33}
    calibration |= {"decentralized_s": 0.05, "adamw_s": 0.05}
    cluster = Cluster(nodes=2, ranks_per_node=2, inter_bytes_per_s=25e6, intra_bytes_per_s=1e9)
    plain = rates.predictions(METHODS["aer"], calibration, cluster)
    node = rates.predictions(METHODS["aer-node"], calibration, cluster)
    assert node["inter_mb"] == pytest.approx(plain["inter_mb"])  # nothing more crosses the nodes
    assert node["comm_ms"] > plain["comm_ms"]  # the node's all-reduce of g and g**2
    assert "optim.intra_node=all_reduce" in METHODS["aer-node"].args
    # the nodes on complete with bfloat16 updates: aer's inter-node bytes, every step instead of every other
    bf16 = rates.predictions(METHODS["complete-node-bf16"], calibration | {"params": 7.5e6}, cluster)
    method = METHODS["complete-node-bf16"]
    fp32_method = replace(method, args=tuple(a for a in method.args if not a.startswith("optim.exchange")))
    fp32 = rates.predictions(fp32_method, calibration, cluster)
    assert bf16["inter_mb"] == pytest.approx(node["inter_mb"]) and fp32["inter_mb"] == pytest.approx(
        2 * node["inter_mb"]
    )
    assert "optim.exchange=bf16_updates" in METHODS["complete-node-bf16"].args
    # sharing the second moment every 2 steps adds half the bf16 updates' bytes (A, as many values)
    shared = rates.predictions(METHODS["complete-node-bf16-shared"], calibration | {"params": 7.5e6}, cluster)
    assert METHODS["complete-node-bf16-shared"].share_every == 2 and method.share_every == 0
    assert shared["inter_mb"] == pytest.approx(1.5 * bf16["inter_mb"])
    assert shared["comm_ms"] > bf16["comm_ms"]
    assert parse_args(["--data", str(tmp_path)]).methods == ("allreduce", "aer", "complete")
