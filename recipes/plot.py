"""``decentadam-plot``: the curves of finished (or running) recipe runs, from their ``metrics.jsonl``.

::

    decentadam-plot runs/m30k-allreduce runs/m30k-aer --out curves.png
    python -m recipes.plot runs/m30k-* --out curves.png --title "Multi30k En-De, 4 ranks"

Nothing is trained again: each ``RUN`` is a recipe's run directory (``recipes/common/run.py``), read
as it is. The figure has one line per run and two columns, against optimizer steps and against
training time (``train_seconds``: evaluation, logging and saving excluded); its rows are the
validation loss (``valid_nll`` of the translation recipe, ``loss`` of the image recipe), the training
loss (``train_loss``: the mean of the logged steps since the previous evaluation, label-smoothed as
optimized; runs recorded before it existed have no such line) and, for the image recipe, top-1
accuracy. Each line is labelled by the run's name and its optimizer settings from ``config.toml``
(``--label`` to name them yourself). A table of each run's last evaluation goes to stdout.

Exit codes: 0 drawn; 2 a bad command line or a ``RUN`` that is not a run directory (one line saying
which file is missing or unreadable); 6 ``--out`` cannot be written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PlotError", "Run", "label_of", "main", "plot_runs", "read_run", "run"]

VALIDATION_KEYS = ("valid_nll", "loss")
"""The validation loss in a ``metrics.jsonl`` line: the translation recipe's, the image recipe's."""


class PlotError(Exception):
    """A run that cannot be drawn, or an output that cannot be written; ``exit_code`` says which."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Run:
    """One run directory as drawn: its label and its evaluations in the order of the steps."""

    path: Path
    label: str
    points: list[dict[str, float]]

    def series(self, key: str) -> tuple[list[float], list[float], list[float]]:
        """(steps, training minutes, values) of the evaluations that hold ``key``."""
        kept = [p for p in self.points if isinstance(p.get(key), (int, float)) and math.isfinite(p[key])]
        return [p["step"] for p in kept], [p["train_seconds"] / 60 for p in kept], [p[key] for p in kept]


def read_run(path: Path, label: str | None = None) -> Run:
    """The run at ``path``; PlotError naming the file when it is not a run directory with evaluations."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        hint = "" if path.is_dir() else " (the directory does not exist)"
        raise PlotError(
            f"{metrics} does not exist{hint}: give a recipe's run directory (train.output_dir), which "
            "holds metrics.jsonl once its first evaluation is done"
        )
    points: list[dict[str, float]] = []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            point = json.loads(line)
        except json.JSONDecodeError as error:
            raise PlotError(f"{metrics}, line {number}: not JSON ({error.msg})") from None
        if not isinstance(point, dict) or not {"step", "train_seconds"} <= point.keys():
            raise PlotError(f"{metrics}, line {number}: expected an object with step and train_seconds")
        points.append(point)
    if not points:
        raise PlotError(f"{metrics} is empty: the run has not finished its first evaluation")
    points.sort(key=lambda p: p["step"])
    return Run(path, label or label_of(path), points)


def label_of(path: Path) -> str:
    """The run's name and its optimizer settings from ``config.toml`` (the name alone without one)."""
    config = path / "config.toml"
    try:
        optim = tomllib.loads(config.read_text()).get("optim", {})
    except (OSError, tomllib.TOMLDecodeError):
        return path.name
    if optim.get("optimizer") != "decentralized":
        return f"{path.name} ({optim.get('optimizer', '?')}, lr {optim.get('lr', '?')})"
    parts = [str(optim.get("topology", "?"))]
    if optim.get("intra_node") == "all_reduce":
        parts.append(f"nodes of {optim.get('local_world_size', '?')}")
    parts.append(f"second moment {optim.get('second_moment', '?')}")
    if optim.get("accum_steps", 1) != 1:
        parts.append(f"accum {optim['accum_steps']}")
    if optim.get("average_every", 0):
        parts.append(f"average every {optim['average_every']}")
    if optim.get("sync_steps", 0):
        parts.append(f"sync {optim['sync_steps']} steps")
    parts.append(f"lr {optim.get('lr', '?')}")
    return f"{path.name} (decentralized: {', '.join(parts)})"


def validation_key(runs: list[Run]) -> str:
    """The validation-loss key the runs record (both recipes' runs in one figure are refused)."""
    found = {next((k for k in VALIDATION_KEYS if k in r.points[-1]), None) for r in runs}
    if None in found:
        bad = next(r for r in runs if not any(k in r.points[-1] for k in VALIDATION_KEYS))
        raise PlotError(f"{bad.path / 'metrics.jsonl'}: no validation loss ({' or '.join(VALIDATION_KEYS)})")
    if len(found) > 1:
        raise PlotError("the runs come from different recipes (valid_nll and loss): plot them separately")
    return found.pop()  # type: ignore[return-value]


def plot_runs(runs: list[Run], out: Path, title: str | None = None) -> Figure:
    """Draw ``runs`` into ``out`` (a format matplotlib writes, from the suffix); return the closed figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = validation_key(runs)
    rows = [(key, "validation loss"), ("train_loss", "training loss (since the previous evaluation)")]
    if any("top1" in p for r in runs for p in r.points):
        rows.append(("top1", "validation top-1 accuracy"))
    figure, grid = plt.subplots(len(rows), 2, figsize=(12, 3.6 * len(rows)), squeeze=False)
    for (metric, name), (by_step, by_time) in zip(rows, grid, strict=True):
        for one in runs:
            steps, minutes, values = one.series(metric)
            by_step.plot(steps, values, "o-", markersize=3, label=one.label)
            by_time.plot(minutes, values, "o-", markersize=3, label=one.label)
        for axes in (by_step, by_time):
            axes.set_ylabel(name)
            axes.grid(alpha=0.3)
            if not any(one.series(metric)[0] for one in runs):
                axes.text(
                    0.5, 0.5, f"no {metric} recorded", ha="center", va="center", transform=axes.transAxes
                )
        by_step.set_xlabel("optimizer steps")
        by_time.set_xlabel("training time (minutes; evaluation, logging and saving excluded)")
    grid[0][0].legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    try:
        figure.savefig(out, dpi=110)
    except (OSError, ValueError) as error:
        plt.close(figure)
        raise PlotError(f"--out {out}: cannot write it ({error})", exit_code=6) from None
    plt.close(figure)
    return figure


def summary(runs: list[Run]) -> str:
    """One line per run: its last evaluation (step, training time, validation loss, training loss)."""
    key = validation_key(runs)
    lines = [f"{'run':<40} {'step':>7} {'minutes':>8} {key:>10} {'train_loss':>10}"]
    for one in runs:
        last = one.points[-1]
        train = last.get("train_loss")
        lines.append(
            f"{one.path.name[:40]:<40} {last['step']:>7} {last['train_seconds'] / 60:>8.1f} "
            f"{last[key]:>10.4f} {'-' if train is None else f'{train:.4f}':>10}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decentadam-plot",
        description="Validation and training loss of recipe runs against steps and training time, from "
        "their metrics.jsonl (nothing is trained again).",
    )
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="a recipe's run directory")
    parser.add_argument(
        "--out", type=Path, default=Path("curves.png"), help="the figure (default curves.png)"
    )
    parser.add_argument("--title", default=None, help="the figure's title")
    parser.add_argument(
        "--label", action="append", default=None, metavar="TEXT",
        help="a run's label, once per RUN in their order (default: its name and optimizer settings)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> list[Run]:
    """Parse ``argv``, draw, print the table; a :class:`PlotError` exits with its code and one line."""
    args = parser().parse_args(argv)
    try:
        if args.label is not None and len(args.label) != len(args.runs):
            raise PlotError(f"{len(args.label)} --label for {len(args.runs)} runs: give one per RUN, or none")
        labels: list[Any] = args.label or [None] * len(args.runs)
        runs = [read_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise PlotError(f"--out {args.out}: cannot create its folder ({error})", exit_code=6) from None
        plot_runs(runs, args.out, args.title)
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    print(summary(runs))
    print(f"wrote {args.out}")
    return runs


def run() -> None:
    """The console command ``decentadam-plot``."""
    main()


if __name__ == "__main__":
    run()
