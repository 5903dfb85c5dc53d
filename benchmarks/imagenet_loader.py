"""Images/s of the image recipe's training loader per DataLoader worker, JPEG decoding included.

Run from the repository root (on a shared machine, under its CPU lock)::

    python -m benchmarks.imagenet_jpegs runs/imagenet-jpegs
    flock /tmp/decentadam-cpu.lock python -m benchmarks.imagenet_loader runs/imagenet-jpegs

``DATA`` is any ``data=`` the recipe takes (``benchmarks.imagenet_jpegs`` writes an image folder of
ImageNet-sized JPEGs; a real ImageNet folder works the same way). The loader is the recipe's own:
``data.open_splits`` on the preset's splits, ``data.Images`` with the preset's ``TrainTransform``
(random resized crop to 224, horizontal flip, scale and normalise; torchvision resizes when it is
installed, else PIL), ``data.train_batches`` of ``--batch`` images (64: the ResNet-50 preset's
global batch of 1024 on 16 GPUs) and ``data.loader``; ``data.loader_throughput`` times it after the
first ``workers + 1`` batches (the workers' start), ``--repeats`` times for each worker count.

It also times, in this process and on one thread, what one image costs: ``decode`` (open the file,
decode the JPEG, convert to RGB: ``source.load``) and ``decode + transform`` (the dataset's
``__getitem__``), over the first ``--sample`` images of a fixed shuffled order. What the 1-worker rate
costs beyond them is collation and handing the batch to the training process.

The per-worker rate is the 1-worker figure: one worker process, the main process doing nothing but
receiving. Workers scale at most with the free cores: on a machine of C cores ``C`` workers are the
useful maximum, and the training process needs a core too. Writes ``benchmarks/results/
imagenet_loader.{json,md}`` (``--out`` for another stem), with the workers a GPU needs at the rates
of ``GPU_RATES`` (where each comes from: docs/benchmarks.md, section "ImageNet loader").
"""

from __future__ import annotations

if not __package__:  # run as a file: the `benchmarks` package would not be importable
    raise SystemExit(
        f"{__file__} is a module of the benchmarks package: run python -m benchmarks.imagenet_loader "
        "from the repository root"
    )

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.machine import machine
from recipes.imagenet import config, data

RESULTS = Path(__file__).resolve().parent / "results" / "imagenet_loader"

GPU_RATES = {
    "ResNet-50 per T4, Decent-DP's AER run (derived)": 103.0,
    "ResNet-50 per A100, A2CiD2's AR-SGD run (derived)": 176.0,
    "ResNet-50 per A100, A2CiD2's fastest worker (derived)": 199.0,
    "ResNet-50 per A100 with AMP (an assumption, widely reported)": 2750.0,
}
"""Training images/s of one GPU; how each is derived or assumed: docs/benchmarks.md, "ImageNet loader"."""


def per_image_ms(dataset: data.Images, indices: list[int]) -> dict[str, float]:
    """Milliseconds per image, on this thread: decoding alone, and decoding plus the training transform."""
    start = time.perf_counter()
    for index in indices:
        dataset.source.load(index)
    decode = time.perf_counter() - start
    start = time.perf_counter()
    for index in indices:
        dataset[(0, index)]
    both = time.perf_counter() - start
    return {
        "decode_ms": 1000 * decode / len(indices),
        "decode_transform_ms": 1000 * both / len(indices),
        "transform_ms": 1000 * (both - decode) / len(indices),
    }


def folder_summary(source: data.ImageSource, indices: list[int]) -> dict[str, Any]:
    """Mean width, height and file size of ``indices`` (an image folder: its headers and files only)."""
    if not isinstance(source, data.ImageFolder):
        return {"images": len(source), "classes": len(source.classes)}
    paths = [source.samples[i][0] for i in indices]
    sizes = []
    for path in paths:
        with Image.open(path) as image:  # reads the header only
            sizes.append(image.size)
    return {
        "images": len(source),
        "classes": len(source.classes),
        "measured_on": len(paths),
        "mean_width": round(float(np.mean([w for w, _ in sizes])), 1),
        "mean_height": round(float(np.mean([h for _, h in sizes])), 1),
        "mean_kb": round(float(np.mean([p.stat().st_size for p in paths])) / 1000, 1),
    }


def commit() -> str:
    """The repository's commit, ``+dirty`` when files differ from it; ``unknown`` outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    revision = commit()  # before the minutes of timing, in which the working tree may change
    cfg = config.load(args.preset, [f"data={args.data}"])
    d = cfg.data
    torch.set_num_threads(1)  # as in a loader worker: one thread per process
    train, _ = data.open_splits(d.path, d.train_split, d.val_split)
    transform = data.TrainTransform(d.image_size, d.scale, d.ratio, d.hflip, d.mean, d.std)
    dataset = data.Images(train, transform, seed=0)
    batches = data.train_batches(len(dataset), args.batch, seed=0, epoch=0, rank=0, world_size=1)
    order = np.random.default_rng(0).permutation(len(dataset))[: args.sample].tolist()
    dataset[(0, order[0])]  # first-call costs (imports, allocator) stay out of the timing
    rates: dict[str, list[float]] = {}
    for workers in args.workers:
        rates[str(workers)] = [
            data.loader_throughput(dataset, batches, workers, warmup=workers + 1) for _ in range(args.repeats)
        ]
    per_worker = float(np.mean(rates["1"])) if "1" in rates else float("nan")
    costs = per_image_ms(dataset, order)
    return {
        "command": args.command,
        "commit": revision,
        "machine": machine(),
        "data": {"path": args.data, **folder_summary(train, order)},
        "settings": {
            "preset": args.preset,
            "batch": args.batch,
            "batches_per_pass": len(batches),
            "repeats": args.repeats,
            "image_size": d.image_size,
            "scale": list(d.scale),
            "ratio": list(d.ratio),
            "hflip": d.hflip,
            "resize": "torchvision" if transform.torchvision else "PIL",
            "sample": len(order),
        },
        "images_per_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "images_per_s_mean": {k: round(float(np.mean(v)), 1) for k, v in rates.items()},
        "per_worker_images_per_s": round(per_worker, 1),
        "per_image_ms": {k: round(v, 2) for k, v in costs.items()},
        "loader_overhead_ms": round(1000 / per_worker - costs["decode_transform_ms"], 2),
        "workers_needed": {
            name: {"gpu_images_per_s": rate, "workers": math.ceil(rate / per_worker)}
            for name, rate in GPU_RATES.items()
        },
    }


def markdown(report: dict[str, Any]) -> str:
    m, d, s, cost = report["machine"], report["data"], report["settings"], report["per_image_ms"]
    lines = [
        "# ImageNet loader: images/s per DataLoader worker, decode included",
        "",
        f"- command: `{report['command']}`",
        f"- commit {report['commit']}, {m['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores (shared; load average at the end {m['load']}); "
        f"Python {m['python']}, torch {m['torch']}, resize by {s['resize']}",
        f"- data: `{d['path']}`, {d['images']} training images in {d['classes']} classes"
        + (
            f"; mean {d['mean_width']:.0f} x {d['mean_height']:.0f} pixels, {d['mean_kb']:.0f} KB "
            f"(over {d['measured_on']})"
            if "mean_kb" in d
            else ""
        ),
        f"- loader: the recipe's (`{s['preset']}` preset's transform: random resized crop to "
        f"{s['image_size']}, scale {s['scale']}, flip {s['hflip']}, normalise), batches of {s['batch']}, "
        f"{s['batches_per_pass']} per pass, the first `workers + 1` not timed; {s['repeats']} passes each",
        "",
        "| DataLoader workers | images/s per pass | mean images/s |",
        "|---:|---|---:|",
    ]
    for workers, rates in report["images_per_s"].items():
        mean = report["images_per_s_mean"][workers]
        lines.append(f"| {workers} | {', '.join(f'{r:.1f}' for r in rates)} | {mean:.1f} |")
    lines += [
        "",
        f"**Per worker: {report['per_worker_images_per_s']:.1f} images/s** (1 worker; the training "
        "process only receives). With 2 cores, 2 workers share them with the receiving process and "
        "more workers cannot add cores: the rate does not scale past the free cores.",
        "",
        f"Where one image's time goes (this process, one thread, {s['sample']} images):",
        "",
        "| step | ms per image |",
        "|---|---:|",
        f"| decode (open, JPEG decode, RGB) | {cost['decode_ms']:.2f} |",
        f"| transform (crop + resize, flip, to tensor, normalise) | {cost['transform_ms']:.2f} |",
        f"| decode + transform | {cost['decode_transform_ms']:.2f} |",
        f"| the 1-worker loader beyond that (collate, hand-over) | {report['loader_overhead_ms']:.2f} |",
        "",
        "Workers a GPU needs, `ceil(GPU images/s / per-worker images/s)`, at this machine's per-worker "
        'rate (the GPU rates: docs/benchmarks.md, section "ImageNet loader"):',
        "",
        "| GPU rate | images/s | workers |",
        "|---|---:|---:|",
    ]
    for name, need in report["workers_needed"].items():
        lines.append(f"| {name} | {need['gpu_images_per_s']:.0f} | {need['workers']} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.imagenet_loader",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data", help="the recipe's data= (an image folder, datasets directory or hub name)")
    parser.add_argument("--preset", default="resnet50-imagenet-accumadam", help="whose data settings")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="worker counts (default 0 1 2)"
    )
    parser.add_argument("--batch", type=int, default=64, help="images per batch (default 64)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per worker count (default 2)")
    parser.add_argument(
        "--sample", type=int, default=300, help="images for the per-image costs (default 300)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="report stem: OUT.json and OUT.md")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if 1 not in args.workers:
        raise SystemExit("error: --workers must include 1: the per-worker rate is the 1-worker figure")
    args.command = shlex.join(["python", "-m", "benchmarks.imagenet_loader", *argv])
    report = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
