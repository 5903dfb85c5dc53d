"""All-Reduce against AccumAdam (decentadam) on one preset: equal steps, same data, BLEU of each.

::

    python recipes/translation/compare.py --preset multi30k-en-de --data ../shared/data/multi30k \\
        --steps 3000 --out runs/compare-m30k-en-de

trains the preset twice with ``accelerate launch`` on ``--workers`` CPU processes (or GPUs:
``--gpu``), ``--optimizer allreduce`` then ``--optimizer decentralized``, with the same seed, data,
and number of optimizer steps; scores each run's final checkpoint with ``eval/bleu.py`` on the
preset's test split; and writes ``OUT/report.json`` (commands, wall and training times, validation
curves, BLEU and chrF with sacreBLEU's signatures) and ``OUT/report.png`` (validation loss against
training time and against steps). Extra ``key=value`` arguments go to both trainings.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OPTIMIZERS = ("allreduce", "decentralized")
LABELS = {"allreduce": "All-Reduce (DDP + AdamW)", "decentralized": "AccumAdam (decentadam)"}


def launch_command(workers: int, gpu: bool) -> list[str]:
    """``accelerate launch`` for ``workers`` processes on this machine (gloo on CPU unless ``gpu``)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_machines",
        "1",
        "--dynamo_backend",
        "no",
    ]
    if workers > 1:
        command += ["--multi_gpu", "--num_processes", str(workers)]
    else:
        command += ["--num_processes", "1"]
    if not gpu:
        command += ["--mixed_precision", "no"]
    return command


def run_logged(command: list[str], env: dict[str, str], prefix: str, log: Path) -> float:
    """Run ``command``, copy its output to ``log``, echo its summary lines; return its wall seconds."""
    print(f"$ {shlex.join(command)}", flush=True)
    begin = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
        assert process.stdout is not None
        for line in process.stdout:
            handle.write(line)
            text = line.rsplit("\r", 1)[-1].strip()
            if text.startswith(("step ", "done", "error", "BLEU", "chrF")) or "training pairs" in text:
                print(f"  [{prefix}] {text}", flush=True)
        code = process.wait()
    if code != 0:
        tail = log.read_text().splitlines()[-30:]
        raise RuntimeError(f"{prefix} failed with exit code {code}; the end of {log}:\n" + "\n".join(tail))
    return time.perf_counter() - begin


def train(
    preset: str, optimizer: str, run: Path, overrides: list[str], workers: int, gpu: bool
) -> tuple[list[str], float]:
    """Train one run; return the command and its wall seconds (start-up included)."""
    command = [
        *launch_command(workers, gpu),
        str(HERE / "train.py"),
        "--preset",
        preset,
        "--optimizer",
        optimizer,
        f"train.output_dir={run}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if not gpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return command, run_logged(command, env, optimizer, run.parent / f"{run.name}.log")


def bleu(
    run: Path, data: str, split: str, src: str, tgt: str, extra: list[str]
) -> tuple[list[str], dict[str, Any]]:
    """Score the run's last checkpoint with eval/bleu.py; return the command and its JSON."""
    scores = run / f"{split}.{src}-{tgt}.json"
    command = [
        sys.executable,
        str(ROOT / "eval" / "bleu.py"),
        str(run),
        "--average-last",
        "1",
        "--data",
        data,
        "--split",
        split,
        "--src",
        src,
        "--tgt",
        tgt,
        "--json",
        str(scores),
        *extra,
    ]
    run_logged(command, dict(os.environ), "bleu", run.parent / f"{run.name}.bleu.log")
    return command, json.loads(scores.read_text())


def curve(run: Path) -> list[dict[str, float]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def plot_curves(
    curves: dict[str, list[dict[str, float]]], title: str, path: Path, target: float | None = None
) -> None:
    """Validation loss against training time and against steps, one line per label; ``target`` a
    dashed horizontal line."""
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


def plot(report: dict[str, Any], path: Path) -> None:
    curves = {f"{LABELS[name]}: BLEU {r['bleu']:.2f}": r["curve"] for name, r in report["runs"].items()}
    plot_curves(curves, f"{report['preset']}, {report['workers']} processes, {report['steps']} steps", path)


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
    workers: int = 4,
    gpu: bool = False,
    overrides: list[str] | None = None,
    bleu_args: list[str] | None = None,
    optimizers: tuple[str, ...] = OPTIMIZERS,
) -> dict[str, Any]:
    """Train and score each optimizer; write OUT/report.json and OUT/report.png; return the report."""
    sys.path.insert(0, str(HERE))
    import config

    cfg = config.load(preset, [f"data={data}", *(overrides or [])])
    report = start_report(
        out,
        {
            "preset": preset,
            "data": data,
            "steps": steps,
            "workers": workers,
            "overrides": overrides or [],
            "src": cfg.data.src,
            "tgt": cfg.data.tgt,
            "split": cfg.data.test_split,
        },
    )
    for optimizer in optimizers:
        run = out / optimizer
        settings = [f"data={data}", f"train.max_steps={steps}", *(overrides or [])]
        train_command, wall = train(preset, optimizer, run, settings, workers, gpu)
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
            f"{LABELS[name]:26s} BLEU {result['bleu']:6.2f}  chrF {result['chrf']:6.2f}  valid nll "
            f"{result['final_valid_nll']:.3f}  {result['train_seconds']:.0f} s training, "
            f"{result['wall_seconds']:.0f} s wall"
        )
    lines.append(f"BLEU|{next(iter(report['runs'].values()))['bleu_signature']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data", required=True, help="data directory (or hub name) for both runs")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps of each run")
    parser.add_argument(
        "--out", required=True, help="report directory (runs in OUT/allreduce, OUT/decentralized)"
    )
    parser.add_argument("--workers", type=int, default=4, help="processes per run (default 4)")
    parser.add_argument("--gpu", action="store_true", help="one process per GPU instead of CPU processes")
    parser.add_argument("--bleu-arg", action="append", default=[], help="passed to eval/bleu.py (repeatable)")
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
        workers=args.workers,
        gpu=args.gpu,
        overrides=args.overrides,
        bleu_args=args.bleu_arg,
        optimizers=(args.only,) if args.only else OPTIMIZERS,
    )
    print(summary(report))
    print(f"report: {Path(args.out) / 'report.json'}, {Path(args.out) / 'report.png'}")


if __name__ == "__main__":
    main()
