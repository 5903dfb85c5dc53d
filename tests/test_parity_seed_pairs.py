"""benchmarks.parity.seed_pairs: same-seed differences to All-Reduce and the parity targets over seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.parity import seed_pairs


def write_report(path: Path, curve: dict[int, float], bleu: float | None, chrf: float | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {
        "curve": [{"step": s, "valid_nll": v, "train_seconds": 1.0} for s, v in curve.items()],
        "bleu": bleu,
    }
    if chrf is not None:
        run["chrf"] = chrf
    path.write_text(json.dumps(run))
    return str(path)


def test_differences_means_and_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # seed 1: All-Reduce inside a comparison's runs; seed 2: two single reports; seed 3: a screen's logs
    comparison = tmp_path / "cmp" / "report.json"
    comparison.parent.mkdir()
    runs = {
        "allreduce": {
            "curve": [{"step": 400, "valid_nll": 3.40}, {"step": 1200, "valid_nll": 2.25}],
            "bleu": 33.0,
        },
        "decentralized": {"curve": [{"step": 400, "valid_nll": 9.0}], "bleu": 1.0},
    }
    comparison.write_text(json.dumps({"runs": runs}))
    ours1 = write_report(tmp_path / "a" / "report.json", {400: 3.50, 800: 2.6, 1200: 2.29}, 32.0, 56.0)
    ours2 = write_report(tmp_path / "a" / "report-seed2.json", {400: 3.44, 1200: 2.26}, 33.2, 57.0)
    ar2 = write_report(tmp_path / "a" / "ar-seed2.json", {400: 3.42, 1200: 2.25}, 33.0, 56.5)
    screen = tmp_path / "screen"
    screen.mkdir()
    for name, curve, bleu in (
        ("de-node-s3", {400: 3.49, 1200: 2.30}, 32.6),
        ("de-ar-s3", {400: 3.43, 1200: 2.24}, 32.8),
    ):
        lines = [json.dumps({"step": s, "valid_nll": v}) for s, v in curve.items()] + [
            json.dumps({"bleu": bleu})
        ]
        (screen / f"{name}.log").write_text("\n".join(lines) + "\n")

    out = tmp_path / "pairs.md"
    seed_pairs.main(
        [
            *("--pair", ours1, f"{comparison}:allreduce", "--pair", ours2, ar2),
            *("--pair", str(screen / "de-node-s3.log"), str(screen / "de-ar-s3.log"), "--out", str(out)),
        ]
    )
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    # the steps every pair has (800 is only in seed 1's run); chrF only where both runs have it
    assert "| run | against | 400 | 1200 | BLEU | chrF |" in printed
    assert "| a/report | cmp/report:allreduce | +0.100 | +0.040 | -1.00 |  |" in printed
    assert "| a/report-seed2 | a/ar-seed2 | +0.020 | +0.010 | +0.20 | +0.50 |" in printed
    assert "| screen/de-node-s3 | screen/de-ar-s3 | +0.060 | +0.060 | -0.20 |  |" in printed
    # 400: gaps 0.10, 0.02, 0.06 -> mean 0.06, standard deviation 0.04, standard error 0.04 / sqrt(3)
    means = "+0.060 ± 0.023 | +0.037 ± 0.015 | -0.33 ± 0.35 | +0.50"
    assert f"| mean ± standard error (3) | | {means} |" in printed
    targets = [
        "- step 400 within 0.05 nats: missed by 0.010 on the mean (+0.060); 1 of 3 runs within it",
        "- step 1200 within 0.05 nats: met on the mean (+0.037); 2 of 3 runs within it",
        "- BLEU at least All-Reduce's - 0.5: met on the mean (-0.33); 2 of 3 runs meet it",
    ]
    assert printed.endswith("\n".join(targets) + "\n")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing.json", "no such file (give a report.json, report.json:RUN or a screen's NAME.log)"),
        ("cmp.json:average", "name one of this comparison's runs after ':' (allreduce)"),
        ("one.json:allreduce", "holds one run, not a comparison: give it without ':allreduce'"),
        ("empty.json", "no validation NLL in its curve"),
        ("stopped.log", "no validation NLL in this log (did the run reach an evaluation?)"),
    ],
)
def test_bad_runs_are_errors_that_say_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    (tmp_path / "cmp.json").write_text(json.dumps({"runs": {"allreduce": {"curve": [], "bleu": 1.0}}}))
    write_report(tmp_path / "one.json", {400: 3.0}, 30.0)
    write_report(tmp_path / "empty.json", {}, 30.0)
    (tmp_path / "stopped.log").write_text("starting\n")
    good = write_report(tmp_path / "good.json", {400: 3.0}, 30.0)
    with pytest.raises(SystemExit):
        seed_pairs.main(["--pair", str(tmp_path / spec), good])
    assert message in capsys.readouterr().err


def test_pairs_without_a_common_step_are_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    early = write_report(tmp_path / "early.json", {100: 5.0}, None)
    late = write_report(tmp_path / "late.json", {400: 3.0}, None)
    with pytest.raises(SystemExit):
        seed_pairs.main(["--pair", early, late])
    assert "the pairs have no evaluation step in common" in capsys.readouterr().err


def test_a_target_step_that_a_pair_lacks_is_not_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = [
        write_report(tmp_path / f"{n}.json", {400: v, 1200: v - 1}, None)
        for n, v in (("a", 3.08), ("b", 3.0))
    ]
    short = [write_report(tmp_path / f"{n}.json", {400: 3.0}, None) for n in ("c", "d")]
    seed_pairs.main(["--pair", *full, "--pair", *short])
    printed = capsys.readouterr().out
    assert "- step 400 within 0.05 nats: met on the mean (+0.040); 1 of 2 runs within it" in printed
    assert "- step 1200: not in every pair's curves, not judged" in printed  # not judged on pair 1 alone
