"""What the BLEU target asks of the loss: test BLEU against the final validation NLL, one line.

Reads runs that have both (a screen's logs, ``benchmarks.parity.screen --bleu``; the recipe's
``report.json`` files, one run or a comparison's ``runs``), fits ``BLEU = slope * NLL + intercept``
by least squares, and prints a table of every run with its residual, the residuals' spread, and
the validation NLL gap that costs 0.5 BLEU on that line (issue 21's BLEU target as a loss target)::

    python -m benchmarks.parity.bleu_fit --screen benchmarks/results/parity_screen/seeds-1200 \\
        --report recipes/translation/results/multi30k-en-de-node-bf16/report.json \\
        --log benchmarks/results/parity_screen/bf16-seeds-1200/de-node-bf16-s1.log

(``--log`` takes one run of a screen, for a screen that repeats runs already given: a simulated
All-Reduce run on the GPU is bitwise the same in every screen that has it, and counting it twice
would weigh it twice.)

Give runs of one language pair and test set: the line is theirs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.parity.screen import read_bleu, read_curve

BLEU_GAP = 0.5
"""Issue 21's target: BLEU at least All-Reduce's minus this."""


@dataclass(frozen=True)
class Point:
    name: str
    nll: float  # validation NLL at the run's last evaluation
    bleu: float


@dataclass(frozen=True)
class Fit:
    slope: float  # BLEU per nat of validation NLL
    intercept: float
    residual_sd: float  # of BLEU around the line (n - 2 degrees of freedom)

    def bleu(self, nll: float) -> float:
        return self.slope * nll + self.intercept


@dataclass(frozen=True)
class Run:
    """One run's validation curve and scores, from a screen's log or a recipe report."""

    name: str  # where it came from: FOLDER/FILE, with :RUN for a comparison's run
    curve: dict[int, float]  # step -> validation NLL
    bleu: float | None
    chrf: float | None


def log_run(log: Path) -> Run:
    """A screen's run (``benchmarks.parity.screen``: ``NAME.log``; its logs have no chrF)."""
    return Run(f"{log.parent.name}/{log.stem}", read_curve(log), read_bleu(log), None)


def report_runs(path: Path) -> dict[str, Run]:
    """A recipe report's runs by name: a comparison's ``runs``, or its one run under ``""``."""
    report = json.loads(path.read_text())
    runs: dict[str, Any] = report.get("runs", {"": report})
    return {
        name: Run(
            f"{path.parent.name}/{path.stem}" + (f":{name}" if name else ""),
            {int(p["step"]): float(p["valid_nll"]) for p in run.get("curve", []) if "valid_nll" in p},
            None if run.get("bleu") is None else float(run["bleu"]),
            None if run.get("chrf") is None else float(run["chrf"]),
        )
        for name, run in runs.items()
    }


def _point(run: Run) -> Point | None:
    """The run's final validation NLL and BLEU, if it has both."""
    if not run.curve or run.bleu is None:
        return None
    return Point(run.name, run.curve[max(run.curve)], run.bleu)


def screen_points(directory: Path) -> list[Point]:
    """Every run of a screen whose log ends with a BLEU line."""
    return [p for log in sorted(directory.glob("*.log")) if (p := _point(log_run(log))) is not None]


def report_points(path: Path) -> list[Point]:
    """A recipe report's run (``curve`` and ``bleu``) or each run of a comparison's ``runs``."""
    return [p for run in report_runs(path).values() if (p := _point(run)) is not None]


def fit(points: list[Point]) -> Fit:
    """Least squares of BLEU on NLL; needs three points and two different losses."""
    if len(points) < 3 or len({p.nll for p in points}) < 2:
        raise ValueError(f"a line needs at least 3 runs with 2 different losses, got {len(points)}")
    nlls, bleus = [p.nll for p in points], [p.bleu for p in points]
    slope, intercept = statistics.linear_regression(nlls, bleus)
    residuals = [b - (slope * x + intercept) for x, b in zip(nlls, bleus, strict=True)]
    spread = (sum(r * r for r in residuals) / (len(points) - 2)) ** 0.5
    return Fit(slope, intercept, spread)


def render(points: list[Point], line: Fit) -> str:
    rows = [
        f"BLEU = {line.slope:.1f} x NLL + {line.intercept:.1f} over {len(points)} runs; residual standard "
        f"deviation {line.residual_sd:.2f} BLEU. {BLEU_GAP:g} BLEU is {BLEU_GAP / abs(line.slope):.3f} nats "
        "of validation NLL on this line.",
        "",
        "| run | final valid NLL | BLEU | on the line | residual |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in points:
        on_line = line.bleu(p.nll)
        rows.append(f"| {p.name} | {p.nll:.3f} | {p.bleu:.2f} | {on_line:.2f} | {p.bleu - on_line:+.2f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.parity.bleu_fit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--screen", type=Path, action="append", default=[], help="a screen's OUT (repeatable)"
    )
    parser.add_argument("--report", type=Path, action="append", default=[], help="a report.json (repeatable)")
    parser.add_argument(
        "--log",
        type=Path,
        action="append",
        default=[],
        help="one run of a screen, NAME.log (repeatable): where its screen repeats runs given already",
    )
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    points = [p for d in args.screen for p in screen_points(d)] + [
        p for path in args.report for p in report_points(path)
    ]
    for log in args.log:
        point = _point(log_run(log)) if log.is_file() else None
        if point is None:
            parser.error(f"--log {log}: not a screen's log with a validation NLL and a BLEU line")
        points.append(point)
    try:
        markdown = render(points, fit(points))
    except ValueError as error:
        parser.error(f"{error}: give screens run with --bleu or reports with a BLEU")
    if args.out is not None:
        args.out.write_text(markdown)
    print(markdown, end="")


if __name__ == "__main__":
    main()
