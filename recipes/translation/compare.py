"""All-Reduce against DecentralizedAdam (decentadam) on one preset: equal steps, same data, BLEU of each.

::

    python -m recipes.translation.compare --preset multi30k-en-de --data DATA/multi30k \\
        --steps 3000 --out runs/compare-m30k-en-de

trains the preset twice with ``accelerate launch -m recipes.translation.train`` on ``--processes``
CPU processes (or GPUs: ``--gpu``), ``--optimizer allreduce`` then ``--optimizer decentralized``,
with the same seed, data, and number of optimizer steps; scores each run's final checkpoint with
``python -m eval.bleu`` on the preset's test split; and writes ``OUT/report.json`` (commands, wall
and training times, validation curves, BLEU and chrF with sacreBLEU's signatures) and
``OUT/report.png`` (validation loss against training time and against steps). Extra ``key=value``
arguments go to both trainings.
"""

from __future__ import annotations

if not __package__:  # run as a file, `recipes` would not be importable
    raise SystemExit(
        f"{__file__} is a module of the recipes package: "
        "run python -m recipes.translation.compare from the repository root"
    )

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recipes.common.launch import accelerate_launch, environment, run_logged
from recipes.translation import config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.figure import Figure

OPTIMIZERS = ("allreduce", "decentralized")
LABELS = {"allreduce": "All-Reduce (DDP + AdamW)", "decentralized": "DecentralizedAdam (decentadam)"}


def train(
    preset: str, optimizer: str, run: Path, overrides: list[str], processes: int, gpu: bool
) -> tuple[list[str], float]:
    """Train one run; return the command and its wall seconds (start-up included)."""
    command = [
        *accelerate_launch("recipes.translation.train", processes, gpu=gpu),
        "--preset", preset, "--optimizer", optimizer, f"train.output_dir={run}", *overrides,
    ]  # fmt: skip
    return command, run_logged(command, run.parent / f"{run.name}.log", optimizer, env=environment(gpu=gpu))


def bleu(
    run: Path, data: str, split: str, src: str, tgt: str, extra: list[str]
) -> tuple[list[str], dict[str, Any]]:
    """Score the run's last checkpoint with ``eval.bleu``; return the command and its result."""
    scores = run / f"{split}.{src}-{tgt}.json"
    command = [
        sys.executable, "-m", "eval.bleu", str(run), "--average-last", "1", "--data", data,
        "--split", split, "--src", src, "--tgt", tgt, "--output", str(scores),
        "--hypotheses", str(scores.with_suffix(".hyp")), *extra,
    ]  # fmt: skip
    run_logged(command, run.parent / f"{run.name}.bleu.log", "bleu", env=environment(), echo=("BLEU", "chrF"))
    return command, json.loads(scores.read_text())


def curve(run: Path) -> list[dict[str, float]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def time_to_reach(
    points: Sequence[dict[str, float]], target: float, key: str = "train_seconds"
) -> float | None:
    """Training seconds (or another ``key`` of the points, e.g. ``step``) at which the validation loss
    first reaches ``target``, linearly interpolated between evaluations; the first evaluation's value
    if it is already there; None if never."""
    previous: dict[str, float] | None = None
    for point in points:
        if point["valid_nll"] <= target:
            if previous is None:
                return point[key]
            fraction = (previous["valid_nll"] - target) / (previous["valid_nll"] - point["valid_nll"])
            return previous[key] + fraction * (point[key] - previous[key])
        previous = point
    return None


def plot_curves(
    curves: dict[str, list[dict[str, float]]], title: str, path: Path, target: float | None = None
) -> Figure:
    """Validation loss against training time and against steps, one line per label; ``target`` a
    dashed horizontal line. Saved to ``path``; the (closed) figure is returned for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in curves.items():
        losses = [p["valid_nll"] for p in points]
        by_time.plot([p["train_seconds"] / 60 for p in points], losses, "o-", label=label)
        by_step.plot([p["step"] for p in points], losses, "o-", label=label)
    by_time.set_xlabel("training time (minutes, evaluation excluded)")
    by_step.set_xlabel("optimizer steps")
    for axes in (by_time, by_step):
        if target is not None:
            axes.axhline(target, color="grey", linestyle="--", linewidth=1)
        axes.set_ylabel("validation loss (NLL per token)")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return figure


def plot(report: dict[str, Any], path: Path) -> Figure:
    curves = {f"{LABELS[name]}: BLEU {r['bleu']:.2f}": r["curve"] for name, r in report["runs"].items()}
    title = f"{report['preset']}, {report['processes']} processes, {report['steps']} steps"
    return plot_curves(curves, title, path)


def start_report(out: Path, header: dict[str, Any]) -> dict[str, Any]:
    """A report with ``header`` and no runs, or the runs of ``OUT/report.json`` when its header matches.

    So ``--only allreduce`` then ``--only decentralized`` with the same arguments build one report:
    each training can hold the CPU lock on its own, and neither run is repeated. A report whose
    header differs (another preset, step count, data or overrides) is replaced, not mixed in.
    """
    path = out / "report.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        if {key: previous.get(key) for key in header} == header:
            return {**header, "runs": previous.get("runs", {})}
        print(f"{path} was written with other arguments: starting a new report", flush=True)
    return {**header, "runs": {}}


def compare(
    preset: str,
    data: str,
    steps: int,
    out: Path,
    *,
    processes: int = 4,
    gpu: bool = False,
    overrides: list[str] | None = None,
    bleu_args: list[str] | None = None,
    optimizers: tuple[str, ...] = OPTIMIZERS,
) -> dict[str, Any]:
    """Train and score each optimizer; write OUT/report.json and OUT/report.png; return the report."""
    cfg = config.load(preset, [f"data={data}", *(overrides or [])])
    report = start_report(
        out,
        {
            "preset": preset,
            "data": data,
            "steps": steps,
            "processes": processes,
            "overrides": overrides or [],
            "src": cfg.data.src,
            "tgt": cfg.data.tgt,
            "split": cfg.data.test_split,
        },
    )
    for optimizer in optimizers:
        run = out / optimizer
        settings = [f"data={data}", f"train.max_steps={steps}", *(overrides or [])]
        train_command, wall = train(preset, optimizer, run, settings, processes, gpu)
        bleu_command, scores = bleu(
            run, data, cfg.data.test_split, cfg.data.src, cfg.data.tgt, bleu_args or []
        )
        points = curve(run)
        report["runs"][optimizer] = {
            "train_command": shlex.join(train_command),
            "bleu_command": shlex.join(bleu_command),
            "wall_seconds": round(wall, 1),
            "train_seconds": round(points[-1]["train_seconds"], 1) if points else None,
            "final_valid_nll": points[-1]["valid_nll"] if points else None,
            "curve": points,
            **scores,
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "report.png")
    return report


def summary(report: dict[str, Any]) -> str:
    lines = []
    for name, result in report["runs"].items():
        lines.append(
            f"{LABELS[name]:30s} BLEU {result['bleu']:6.2f}  chrF {result['chrf']:6.2f}  valid nll "
            f"{result['final_valid_nll']:.3f}  {result['train_seconds']:.0f} s training, "
            f"{result['wall_seconds']:.0f} s wall"
        )
    lines.append(f"BLEU|{next(iter(report['runs'].values()))['bleu_signature']}")
    curves = {name: {p["step"]: p["valid_nll"] for p in run["curve"]} for name, run in report["runs"].items()}
    if len(curves) == 2:  # the validation curves side by side, at the steps both evaluated
        a, b = curves.values()
        steps = sorted(set(a) & set(b))
        lines.append("valid nll at step " + " / ".join(str(s) for s in steps))
        lines += [
            f"  {LABELS[name]:30s} " + " / ".join(f"{c[s]:.3f}" for s in steps) for name, c in curves.items()
        ]
        lines.append(f"  {'difference':30s} " + " / ".join(f"{b[s] - a[s]:+.3f}" for s in steps))
        (first, a_run), (second, b_run) = report["runs"].items()
        lines.append(f"steps to reach {LABELS[first]}'s valid nll at each (linear between evaluations)")
        lines.append(f"  {LABELS[second]:30s} " + steps_to_reach(a_run, b_run))
    return "\n".join(lines)


def steps_to_reach(first: dict[str, Any], second: dict[str, Any]) -> str:
    """At each of the first run's evaluations, the step at which the second run first reaches that
    validation loss (linear between its evaluations), and the ratio of the two step counts: on the
    first run's curve is 1.00x, whatever the loss's slope there."""
    cells = []
    for point in (p for p in first["curve"] if p["step"] > 0):
        reached = time_to_reach(second["curve"], point["valid_nll"], key="step")
        cells.append("not reached" if reached is None else f"{reached:.0f} ({reached / point['step']:.2f}x)")
    return " / ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.translation.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data", required=True, help="data directory (or hub name) for both runs")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps of each run")
    parser.add_argument(
        "--out", required=True, help="report directory (runs in OUT/allreduce, OUT/decentralized)"
    )
    parser.add_argument("--processes", type=int, default=4, help="processes per run (default 4)")
    parser.add_argument("--gpu", action="store_true", help="one process per GPU instead of CPU processes")
    parser.add_argument("--bleu-arg", action="append", default=[], help="passed to eval.bleu (repeatable)")
    parser.add_argument(
        "--only",
        choices=OPTIMIZERS,
        help="train and score one optimizer only; a report of the same arguments in OUT keeps its other run",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both runs")
    args = parser.parse_args()
    report = compare(
        args.preset,
        args.data,
        args.steps,
        Path(args.out),
        processes=args.processes,
        gpu=args.gpu,
        overrides=args.overrides,
        bleu_args=args.bleu_arg,
        optimizers=(args.only,) if args.only else OPTIMIZERS,
    )
    print(summary(report))
    print(f"report: {Path(args.out) / 'report.json'}, {Path(args.out) / 'report.png'}")


if __name__ == "__main__":
    main()
