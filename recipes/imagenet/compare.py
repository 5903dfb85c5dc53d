"""All-Reduce against decentralized AccumAdam at equal steps, same data and initial weights; accuracy report.

::

    python -m recipes.imagenet.make_digits runs/mnist-5k
    flock /tmp/decentadam-cpu.lock python -m recipes.imagenet.compare --data runs/mnist-5k \\
        --processes 4 --local-world-size 2 --seeds 0 1 2 --out recipes/imagenet/results/mnist-4proc

trains ``--allreduce-preset`` and ``--decentralized-preset`` (by default the two small MNIST presets,
which differ only in ``[optim]``: the script refuses presets whose data, model or training sections
differ) with ``accelerate launch -m recipes.imagenet.train`` on ``--processes`` CPU processes
(``--gpu``: GPUs), once per seed, and scores each final checkpoint with ``python -m eval.accuracy``.
Before training it measures the data pipeline alone: the images per second that one rank's loader
delivers with the preset's workers (and with ``--loader-workers``), no model. It writes
``OUT/report.json`` (commands, wall and training times, validation curves, held-out top-1/top-5,
loader and training images/s) and ``OUT/report.png`` (validation top-1 against training time and
against steps). Extra ``key=value`` arguments go to both trainings; run directories go to ``--runs``.
"""

from __future__ import annotations

if not __package__:  # run as a file, `recipes` would not be importable
    raise SystemExit(
        f"{__file__} is a module of the recipes package: "
        "run python -m recipes.imagenet.compare from the repository root"
    )

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from recipes.common.launch import accelerate_launch, environment, run_logged
from recipes.common.optim import resolved
from recipes.common.run import step_name
from recipes.imagenet import config, data

ARMS = {"allreduce": "All-Reduce", "decentralized": "AccumAdam"}
CPU_ENV = "ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 "


def effective(preset: str, overrides: list[str]) -> config.Config:
    """The configuration a run of ``preset`` with ``overrides`` writes (its options resolved)."""
    cfg = config.load(preset, overrides)
    cfg.optim = resolved(cfg.optim)
    return cfg


def check_comparable(allreduce: config.Config, decentralized: config.Config) -> None:
    """Equal steps, same data and initialisation: everything but [optim] and the output directory."""
    for section in ("data", "model", "train"):
        a, b = (
            dataclasses.asdict(getattr(allreduce, section)),
            dataclasses.asdict(getattr(decentralized, section)),
        )
        differ = sorted(k for k in a if a[k] != b[k] and k != "output_dir")
        if differ:
            raise SystemExit(
                f"error: the presets differ in [{section}] {', '.join(differ)}: not a comparison at equal "
                "steps on the same data and initial weights (override them to the same values)"
            )
    if (allreduce.optim.optimizer, decentralized.optim.optimizer) != ("allreduce", "decentralized"):
        raise SystemExit(
            "error: --allreduce-preset must train with allreduce, --decentralized-preset with decentralized"
        )


def loader_speed(cfg: config.Config, processes: int, workers: list[int]) -> dict[str, Any]:
    """Images/s of one rank's training loader (decode + random resized crop + flip + normalise)."""
    d, t = cfg.data, cfg.train
    train, _ = data.open_splits(d.path, d.train_split, d.val_split)
    dataset = data.Images(train, data.TrainTransform(d.image_size, d.scale, d.ratio, d.hflip, d.mean, d.std))
    batches = data.train_batches(len(dataset), t.global_batch, seed=0, epoch=0, rank=0, world_size=processes)
    rates = {}
    for count in sorted({d.num_workers, *workers}):
        rates[str(count)] = data.loader_throughput(dataset, batches * 2, count)  # two passes: past the start
    return {
        "per_rank_images_per_s": rates,
        "configured_workers": d.num_workers,
        "images_per_batch": t.global_batch // processes,
        "backend": "torchvision" if data.TORCHVISION else "PIL",
    }


def launch(
    preset: str, run: Path, seed: int, args: argparse.Namespace, extra: list[str]
) -> tuple[list[str], float]:
    """Train one run; return the command and its wall seconds (start-up included)."""
    command = [
        *accelerate_launch("recipes.imagenet.train", args.processes, gpu=args.gpu),
        "--preset", preset, f"data={args.data}", f"train.seed={seed}", "--output-dir", str(run), *extra,
    ]  # fmt: skip
    log = run.parent / f"{run.name}.log"
    return command, run_logged(command, log, run.name, env=environment(gpu=args.gpu))


def score(checkpoint: Path, data_dir: str, split: str) -> dict[str, Any]:
    """``eval.accuracy`` of ``checkpoint``: its result, with the command."""
    result = checkpoint.parent / f"{checkpoint.name}.{split}.json"
    command = [
        sys.executable, "-m", "eval.accuracy", str(checkpoint), "--data", data_dir, "--split", split,
        "--output", str(result),
    ]  # fmt: skip
    run_logged(command, checkpoint.parent / f"{checkpoint.name}.{split}.log", "accuracy", env=environment())
    return {"command": shlex.join(command), **json.loads(result.read_text())}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colours = {"allreduce": "tab:blue", "decentralized": "tab:orange"}
    for arm, runs in report["runs"].items():
        for index, run in enumerate(runs):
            curve = run["curve"]
            label = f"{ARMS[arm]} ({report['label'][arm]})" if index == 0 else None
            top1 = [100 * p["top1"] for p in curve]
            by_time.plot(
                [p["train_seconds"] for p in curve], top1, color=colours[arm], alpha=0.8, label=label
            )
            by_step.plot([p["step"] for p in curve], top1, color=colours[arm], alpha=0.8, label=label)
    low = min(100 * p["top1"] for runs in report["runs"].values() for r in runs for p in r["curve"][1:])
    for axis, name in ((by_time, "training time (s, evaluation excluded)"), (by_step, "optimizer step")):
        axis.set_xlabel(name)
        axis.grid(alpha=0.3)
        axis.set_ylim(max(0.0, low - 1.0), 100.0)
    by_time.set_ylabel("validation top-1 (%)")
    by_step.legend(loc="lower right")
    figure.suptitle(report["title"], fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.imagenet.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True, help="image folder (train/ and val/)")
    parser.add_argument("--allreduce-preset", default="mnist-resnet-small-allreduce")
    parser.add_argument("--decentralized-preset", default="mnist-resnet-small-accumadam")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--local-world-size", type=int, default=2, help="ranks per emulated node (aer)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one training of each optimizer per seed"
    )
    parser.add_argument(
        "--loader-workers", type=int, nargs="*", default=[1, 2], help="also time the loader with these"
    )
    parser.add_argument("--gpu", action="store_true", help="one process per GPU, bf16")
    parser.add_argument("--out", type=Path, required=True, help="report directory")
    parser.add_argument("--runs", type=Path, default=Path("runs/imagenet-compare"), help="run directories")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="for both trainings")
    args = parser.parse_intermixed_args(argv)
    common = [f"data={args.data}", *args.overrides]
    presets = {"allreduce": args.allreduce_preset, "decentralized": args.decentralized_preset}
    configs = {arm: effective(preset, common) for arm, preset in presets.items()}
    check_comparable(configs["allreduce"], configs["decentralized"])
    extra = {
        "allreduce": list(args.overrides),
        "decentralized": [*args.overrides, f"optim.local_world_size={args.local_world_size}"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    print("timing the data pipeline alone ...", flush=True)
    loader = loader_speed(configs["allreduce"], args.processes, args.loader_workers)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in presets}
    for seed in args.seeds:
        for arm, preset in presets.items():
            run = args.runs / f"{arm}-seed{seed}"
            if run.exists():
                raise SystemExit(f"error: {run} exists; remove it or pass another --runs")
            print(f"training {arm} (seed {seed}) -> {run}", flush=True)
            command, wall = launch(preset, run, seed, args, extra[arm])
            curve = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            last = curve[-1]
            checkpoint = run / step_name(int(last["step"]))
            held_out = score(checkpoint, args.data, configs[arm].data.val_split)
            steps, train_seconds = int(last["step"]), float(last["train_seconds"])
            runs[arm].append({
                "seed": seed,
                "command": ("" if args.gpu else CPU_ENV) + shlex.join(command),
                "wall_seconds": round(wall, 1),
                "train_seconds": round(train_seconds, 1),
                "steps": steps,
                "train_images_per_s": steps * configs[arm].train.global_batch / train_seconds,
                "top1": held_out["top1"],
                "top5": held_out["top5"],
                "eval": held_out,
                "curve": curve,
            })  # fmt: skip
            print(f"  top-1 {100 * held_out['top1']:.2f}%  ({wall:.0f} s wall)", flush=True)

    def mean(arm: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs[arm])

    def spread(arm: str, key: str) -> float:
        return statistics.stdev(r[key] for r in runs[arm]) if len(runs[arm]) > 1 else 0.0

    processes = args.processes
    train_rate = {arm: mean(arm, "train_images_per_s") for arm in presets}
    configured = loader["per_rank_images_per_s"][str(loader["configured_workers"])]
    slowest_train_per_rank = min(train_rate.values()) / processes
    cfg = configs["decentralized"]
    report = {
        "title": (
            f"{Path(args.data).name}: {cfg.model.name}, {processes} processes "
            f"({processes // args.local_world_size} nodes x {args.local_world_size}), "
            f"{runs['allreduce'][0]['steps']} steps of {cfg.train.global_batch} images, seeds {args.seeds}"
        ),
        "label": {
            "allreduce": f"{configs['allreduce'].optim.algorithm.upper()}, DDP",
            "decentralized": f"{cfg.optim.topology}, s={cfg.optim.accum_steps}",
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "gpu": args.gpu},
        "presets": presets,
        "overrides": args.overrides,
        "summary": {
            arm: {
                "top1_mean": mean(arm, "top1"),
                "top1_std": spread(arm, "top1"),
                "top1_per_seed": [r["top1"] for r in runs[arm]],
                "top5_mean": mean(arm, "top5"),
                "wall_seconds_mean": mean(arm, "wall_seconds"),
                "train_seconds_mean": mean(arm, "train_seconds"),
                "train_images_per_s": train_rate[arm],
                "train_images_per_s_per_rank": train_rate[arm] / processes,
            }
            for arm in presets
        },
        "decentralized_minus_allreduce_top1_points": 100
        * (mean("decentralized", "top1") - mean("allreduce", "top1")),
        "loader": {
            **loader,
            "slower_than_training": configured < slowest_train_per_rank,
            "note": (
                "per rank, measured in one process with the machine otherwise idle; during training "
                f"{processes} processes share {os.cpu_count()} cores, so each rank's loader gets less"
            ),
        },
        "total_wall_seconds": round(time.perf_counter() - started, 1),
        "runs": runs,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out / "report.png")
    for arm in presets:
        s = report["summary"][arm]
        print(
            f"{ARMS[arm]:>10}: top-1 {100 * s['top1_mean']:.2f}% +- {100 * s['top1_std']:.2f} "
            f"(seeds {[round(100 * v, 1) for v in s['top1_per_seed']]}), "
            f"{s['train_images_per_s']:.0f} images/s training, {s['wall_seconds_mean']:.0f} s wall per run"
        )
    print(
        f"loader alone, per rank: {loader['per_rank_images_per_s']} images/s by workers; report in {args.out}"
    )


if __name__ == "__main__":
    main()
