"""benchmarks.parity.bleu_fit: BLEU against the final validation NLL from screens and reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.parity import bleu_fit


def write_screen_log(path: Path, curve: dict[int, float], bleu: float | None) -> None:
    lines = [json.dumps({"step": s, "valid_nll": v}) for s, v in curve.items()]
    lines += [json.dumps({"bleu": bleu, "chrf": 50.0})] if bleu is not None else []
    path.write_text("warning\n" + "\n".join(lines) + "\n")


def test_the_line_through_screens_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    screen = tmp_path / "screen"
    screen.mkdir()
    write_screen_log(screen / "de-ar-s1.log", {100: 5.0, 1200: 2.0}, 40.0)  # the last evaluation counts
    write_screen_log(screen / "de-node-s1.log", {100: 5.0, 1200: 2.5}, 30.5)
    write_screen_log(screen / "de-stopped.log", {100: 5.0}, None)  # no BLEU: left out
    single = tmp_path / "one" / "report.json"
    single.parent.mkdir()
    single.write_text(json.dumps({"curve": [{"step": 1200, "valid_nll": 3.0}], "bleu": 21.0}))
    compared = tmp_path / "two" / "report.json"
    compared.parent.mkdir()
    runs = {"allreduce": {"curve": [{"step": 9, "valid_nll": 2.25}], "bleu": 35.25}, "decentralized": {}}
    compared.write_text(json.dumps({"runs": runs}))

    out = tmp_path / "fit.md"
    bleu_fit.main(
        ["--screen", str(screen), "--report", str(single), "--report", str(compared), "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    # the points (2, 40), (2.5, 30.5), (3, 21), (2.25, 35.25) lie on BLEU = 78 - 19 NLL
    assert printed.startswith("BLEU = -19.0 x NLL + 78.0 over 4 runs; residual standard deviation 0.00 BLEU.")
    assert "0.5 BLEU is 0.026 nats" in printed
    assert "| screen/de-ar-s1 | 2.000 | 40.00 | 40.00 | +0.00 |" in printed
    assert "| two/report:allreduce | 2.250 | 35.25 | 35.25 | +0.00 |" in printed
    assert "de-stopped" not in printed and "decentralized" not in printed
    # off the line: least squares (numpy's polyfit as the independent reference) and n - 2 degrees of freedom
    points = [bleu_fit.Point("a", 2.0, 40.0), bleu_fit.Point("b", 2.5, 29.0), bleu_fit.Point("c", 3.0, 21.5)]
    line = bleu_fit.fit(points)
    slope, intercept = np.polyfit([2.0, 2.5, 3.0], [40.0, 29.0, 21.5], 1)
    residuals = np.array([40.0, 29.0, 21.5]) - (slope * np.array([2.0, 2.5, 3.0]) + intercept)
    assert (line.slope, line.intercept) == pytest.approx((slope, intercept))
    assert line.residual_sd == pytest.approx(float(np.sqrt((residuals**2).sum() / 1)))


def test_single_logs_join_the_line_and_a_log_without_bleu_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    screen = tmp_path / "screen"
    screen.mkdir()
    write_screen_log(screen / "de-ar-s1.log", {1200: 2.0}, 40.0)
    write_screen_log(screen / "de-node-s1.log", {1200: 2.5}, 30.5)
    other = tmp_path / "other"
    other.mkdir()
    write_screen_log(other / "de-ar-s1.log", {1200: 2.0}, 40.0)  # the same run again: not given
    write_screen_log(other / "de-new-s1.log", {1200: 3.0}, 21.0)
    bleu_fit.main(["--screen", str(screen), "--log", str(other / "de-new-s1.log")])
    printed = capsys.readouterr().out
    assert printed.startswith("BLEU = -19.0 x NLL + 78.0 over 3 runs;")
    assert "| other/de-new-s1 | 3.000 | 21.00 |" in printed and "other/de-ar-s1" not in printed
    write_screen_log(other / "de-stopped.log", {100: 5.0}, None)
    for missing in (other / "de-stopped.log", other / "absent.log"):
        with pytest.raises(SystemExit):
            bleu_fit.main(["--screen", str(screen), "--log", str(missing)])
        error = capsys.readouterr().err
        assert f"--log {missing}: not a screen's log with a validation NLL and a BLEU line" in error


def test_too_few_runs_is_an_error_that_says_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bleu_fit.main(["--screen", str(tmp_path)])
    assert "give screens run with --bleu or reports with a BLEU" in capsys.readouterr().err
