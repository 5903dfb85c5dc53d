"""The parity targets judged over seeds: each decentralized run against All-Reduce with its seed.

Takes pairs of runs (the decentralized one first, then All-Reduce with the same seed), prints the
difference of their validation NLL at every evaluation that all pairs have, of BLEU and of chrF,
the mean over the pairs with its standard error, and the targets: within ``NLL_GAP`` nats at
steps 400 and 1,200, BLEU at least All-Reduce's minus ``BLEU_GAP`` (judged on the mean,
since one run's BLEU moves by more than that between seeds)::

    R=recipes/translation/results
    python -m benchmarks.parity.seed_pairs \\
        --pair $R/multi30k-en-de-node-bf16/report.json $R/multi30k-en-de-all-ranks/report.json:allreduce \\
        --pair $R/multi30k-en-de-node-bf16/report-seed2.json \\
               $R/multi30k-en-de-node-bf16/report-allreduce-seed2.json

A run is a recipe report (``report.json``: one run; ``report.json:NAME``: run NAME of a comparison's
``runs``) or a screen's log (``benchmarks.parity.screen``, ``NAME.log``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.parity.screen import read_bleu, read_curve

NLL_GAP = 0.05
"""The target: validation NLL within this of All-Reduce's at TARGET_STEPS."""
TARGET_STEPS = (400, 1200)
BLEU_GAP = 0.5
"""The target: BLEU at least All-Reduce's minus this."""


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


def load(spec: str) -> Run:
    """A report (``PATH`` or ``PATH:RUN``) or a screen's log (``PATH.log``)."""
    named = ":" in spec and not Path(spec).exists()
    path_text, _, run_name = spec.rpartition(":") if named else (spec, "", "")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"{spec}: no such file (give a report.json, report.json:RUN or a screen's NAME.log)")
    if path.suffix == ".log":
        run = log_run(path)
        if not run.curve:
            raise ValueError(f"{spec}: no validation NLL in this log (did the run reach an evaluation?)")
        return run
    runs = report_runs(path)
    if "" in runs and run_name:
        raise ValueError(f"{spec}: {path} holds one run, not a comparison: give it without ':{run_name}'")
    if run_name not in runs:
        raise ValueError(f"{spec}: name one of this comparison's runs after ':' ({', '.join(runs)})")
    if not runs[run_name].curve:
        raise ValueError(f"{spec}: no validation NLL in its curve")
    return runs[run_name]


@dataclass(frozen=True)
class Pair:
    ours: Run
    reference: Run

    @property
    def steps(self) -> list[int]:
        return sorted(set(self.ours.curve) & set(self.reference.curve))

    def nll_gap(self, step: int) -> float:
        return self.ours.curve[step] - self.reference.curve[step]

    def score_gap(self, score: str) -> float | None:
        ours, reference = getattr(self.ours, score), getattr(self.reference, score)
        return None if ours is None or reference is None else ours - reference


def mean_and_error(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (None for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None)


def _mean_cell(values: list[float], digits: int) -> str:
    mean, error = mean_and_error(values)
    return f"{mean:+.{digits}f}" + ("" if error is None else f" ± {error:.{digits}f}")


def render(pairs: list[Pair]) -> str:
    steps = sorted(set.intersection(*(set(p.steps) for p in pairs)))
    if not steps:
        raise ValueError("the pairs have no evaluation step in common")
    head = ["run", "against", *map(str, steps), "BLEU", "chrF"]
    rows = [f"| {' | '.join(head)} |", "|---|---|" + "---:|" * (len(head) - 2)]
    for p in pairs:
        scores = [p.score_gap(s) for s in ("bleu", "chrf")]
        cells = [f"{p.nll_gap(s):+.3f}" for s in steps]
        cells += ["" if v is None else f"{v:+.2f}" for v in scores]
        rows.append(f"| {p.ours.name} | {p.reference.name} | {' | '.join(cells)} |")
    mean_cells = [_mean_cell([p.nll_gap(s) for p in pairs], 3) for s in steps]
    for score in ("bleu", "chrf"):
        values = [v for p in pairs if (v := p.score_gap(score)) is not None]
        mean_cells.append(_mean_cell(values, 2) if values else "")
    rows.append(f"| mean ± standard error ({len(pairs)}) | | {' | '.join(mean_cells)} |")
    lines = [
        "Differences to All-Reduce with the same seed (validation NLL in nats; BLEU and chrF in points).",
        "",
        *rows,
        "",
        *_targets(pairs),
    ]
    return "\n".join(lines) + "\n"


def _targets(pairs: list[Pair]) -> list[str]:
    lines = []
    for step in TARGET_STEPS:
        if not all(step in p.steps for p in pairs):
            lines.append(f"- step {step}: not in every pair's curves, not judged")
            continue
        gaps = [p.nll_gap(step) for p in pairs]
        met = sum(g <= NLL_GAP for g in gaps)
        mean = statistics.fmean(gaps)
        verdict = "met" if mean <= NLL_GAP else f"missed by {mean - NLL_GAP:.3f}"
        lines.append(
            f"- step {step} within {NLL_GAP:g} nats: {verdict} on the mean ({mean:+.3f}); "
            f"{met} of {len(gaps)} runs within it"
        )
    bleu = [v for p in pairs if (v := p.score_gap("bleu")) is not None]
    if bleu:
        mean = statistics.fmean(bleu)
        verdict = "met" if mean >= -BLEU_GAP else f"missed by {-BLEU_GAP - mean:.2f}"
        met = sum(v >= -BLEU_GAP for v in bleu)
        lines.append(
            f"- BLEU at least All-Reduce's - {BLEU_GAP:g}: {verdict} on the mean ({mean:+.2f}); "
            f"{met} of {len(bleu)} runs meet it"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.parity.seed_pairs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        required=True,
        metavar=("RUN", "ALLREDUCE"),
        help="a decentralized run and All-Reduce with its seed (repeatable)",
    )
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    try:
        pairs = [Pair(load(ours), load(reference)) for ours, reference in args.pair]
        markdown = render(pairs)
    except ValueError as error:
        parser.error(str(error))
    if args.out is not None:
        args.out.write_text(markdown)
    print(markdown, end="")


if __name__ == "__main__":
    main()
