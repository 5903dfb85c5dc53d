"""Time one optimizer step of AccumAdamW against torch.optim.AdamW(foreach=True).

Run from the repository root::

    python benchmarks/optimizer_step.py                   # CUDA when available, else CPU
    python benchmarks/optimizer_step.py --device cpu --threads 2 --steps 30

The model is a transformer-shaped list of parameters (~52M: a 32000 x 512 embedding, 6 blocks of
attention and MLP matrices with biases and layer norms, an untied 32000 x 512 output head). Gradients
are random and filled once: ``step()`` only reads ``.grad``, so no forward or backward is run.
Matrices get ``weight_decay``; biases and norms get none (their own parameter group), as in training.

Every optimizer steps the same parameters and keeps its own state. After a warm-up, the timed steps
of each optimizer are split into ``--rounds`` blocks taken in turn (AdamW, AccumAdamW, ..., AdamW,
...), so that a slow drift of the machine (another job, clocks) falls on every optimizer alike.
With ``accum_steps=4`` one step in four also commits the moments and costs more: the median is the
typical step, the p90 and the mean include the commit steps.

The report goes to ``benchmarks/results/optimizer_step_<device>.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from decentadam import AccumAdamW

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 1.10
BASELINE = "torch AdamW(foreach)"
TARGET = "AccumAdamW(accum_steps=4, foreach)"

LR = 1e-3

ParamGroups = list[dict[str, Any]]


@dataclass(frozen=True)
class Config:
    """One optimizer to time."""

    label: str
    accum_steps: int | None  # None: torch.optim.AdamW
    foreach: bool
    noise_ranks: int = 1

    def make(self, groups: ParamGroups) -> Optimizer:
        # Fresh group dicts: Optimizer.add_param_group fills the dict it is given with its defaults
        # (setdefault), so shared dicts would pass AdamW's foreach=True and the first AccumAdamW's
        # accum_steps on to every later optimizer.
        groups = [dict(group) for group in groups]
        if self.accum_steps is None:
            return torch.optim.AdamW(groups, lr=LR, foreach=self.foreach)
        return AccumAdamW(
            groups, lr=LR, accum_steps=self.accum_steps, noise_ranks=self.noise_ranks, foreach=self.foreach
        )


CONFIGS = (  # the first is the baseline the others are compared with
    Config(BASELINE, accum_steps=None, foreach=True),
    Config("AccumAdamW(accum_steps=1, foreach)", accum_steps=1, foreach=True),
    Config(TARGET, accum_steps=4, foreach=True),
    Config("AccumAdamW(accum_steps=4, for-loop)", accum_steps=4, foreach=False),
    # DecentralizedAdam's default on 16 ranks: the second moment of the mean gradient over all ranks
    Config("AccumAdamW(noise_ranks=16, foreach)", accum_steps=1, foreach=True, noise_ranks=16),
)


@dataclass
class Result:
    """Timings of one optimizer configuration."""

    config: Config
    optimizer: Optimizer
    times_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def p90_ms(self) -> float:
        ordered = sorted(self.times_ms)
        return ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.times_ms)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time AccumAdamW.step() against torch AdamW(foreach).")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where parameters, gradients and optimizer state live (default: cuda when available)",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per optimizer (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per optimizer first (default 5)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="the timed steps are taken in this many interleaved blocks"
    )
    parser.add_argument(
        "--threads", type=int, default=available_cores(), help="torch.set_num_threads (default: all cores)"
    )
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="report path (default: results/...)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False")
    if args.steps < 1 or args.warmup < 0 or not 1 <= args.rounds <= args.steps or args.threads < 1:
        parser.error("need --steps >= 1, --warmup >= 0, 1 <= --rounds <= --steps, --threads >= 1")
    return args


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def transformer_shapes(
    layers: int, vocab: int = 32000, d_model: int = 512, d_ff: int = 2048
) -> list[tuple[int, ...]]:
    """Parameter shapes of a pre-norm transformer language model, in module order."""
    shapes: list[tuple[int, ...]] = [(vocab, d_model)]  # token embedding
    for _ in range(layers):
        shapes += [(d_model,), (d_model,)]  # attention layer norm: weight, bias
        for _ in range(4):  # q, k, v, output projections: weight, bias
            shapes += [(d_model, d_model), (d_model,)]
        shapes += [(d_model,), (d_model,)]  # MLP layer norm
        shapes += [(d_ff, d_model), (d_ff,), (d_model, d_ff), (d_model,)]  # MLP in, out
    shapes += [(d_model,), (d_model,)]  # final layer norm
    shapes += [(vocab, d_model)]  # untied output head
    return shapes


def make_param_groups(layers: int, weight_decay: float, device: torch.device) -> ParamGroups:
    """Parameters with random gradients, split into a decayed (matrices) and an undecayed group."""
    params = []
    for shape in transformer_shapes(layers):
        param = torch.nn.Parameter(torch.randn(shape, device=device) * 0.02)
        param.grad = torch.randn(shape, device=device) * 1e-3
        params.append(param)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(optimizer: Optimizer, steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``steps`` calls to ``optimizer.step()``."""
    times_ms = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    return times_ms


def run(args: argparse.Namespace, device: torch.device, groups: ParamGroups) -> list[Result]:
    results = [Result(config, config.make(groups)) for config in CONFIGS]
    for result in results:
        check_settings(result)
        timed_steps(result.optimizer, args.warmup, device)
    for block in block_sizes(args.steps, args.rounds):
        for result in results:
            result.times_ms += timed_steps(result.optimizer, block, device)
    return results


def check_settings(result: Result) -> None:
    """Fail loudly if an optimizer does not run with the settings its label names."""
    config = result.config
    for group in result.optimizer.param_groups:
        assert group["foreach"] is config.foreach, (config.label, group["foreach"])
        assert group.get("accum_steps") == config.accum_steps, (config.label, group.get("accum_steps"))
        assert group.get("noise_ranks", 1) == config.noise_ranks, (config.label, group.get("noise_ranks"))
        assert group["lr"] == LR


def block_sizes(total: int, parts: int) -> list[int]:
    """``total`` cut into ``parts`` block lengths that differ by at most one."""
    size, extra = divmod(total, parts)
    return [size + (1 if i < extra else 0) for i in range(parts)]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(results: list[Result]) -> str:
    baseline = results[0]
    lines = [
        "| optimizer | median ms | p90 ms | mean ms | median / AdamW | mean / AdamW |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines.append(
            f"| {result.config.label} | {result.median_ms:.1f} | {result.p90_ms:.1f} | {result.mean_ms:.1f} "
            f"| {result.median_ms / baseline.median_ms:.2f}x | {result.mean_ms / baseline.mean_ms:.2f}x |"
        )
    return "\n".join(lines)


def target_line(results: list[Result]) -> str:
    by_label = {result.config.label: result for result in results}
    ratio = by_label[TARGET].median_ms / by_label[BASELINE].median_ms
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    return f"target: {TARGET} <= {TARGET_RATIO:.2f}x {BASELINE}: {verdict} (median ratio {ratio:.2f}x)"


def report(args: argparse.Namespace, device: torch.device, groups: ParamGroups, results: list[Result]) -> str:
    params = [p for group in groups for p in group["params"]]
    n_params = sum(p.numel() for p in params)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return "\n".join(
        [
            f"# Optimizer step: AccumAdamW vs torch AdamW ({device.type})",
            "",
            f"- command: `{shlex.join(sys.orig_argv)}`",
            f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- torch: {torch.__version__}, Python {platform.python_version()}",
            f"- device: {device.type}, {device_name(device)}",
            f"- threads: {torch.get_num_threads()} of {available_cores()} cores; load average at end: {load}",
            f"- parameters: {n_params:,} in {len(params)} float32 tensors ({args.layers} blocks); "
            f"weight_decay {args.weight_decay} on matrices, 0 on biases and norms; lr {LR}",
            f"- steps: {args.warmup} warm-up, then {args.steps} timed per optimizer in {args.rounds} "
            "interleaved blocks",
            "",
            table(results),
            "",
            target_line(results),
            "",
        ]
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    groups = make_param_groups(args.layers, args.weight_decay, device)
    results = run(args, device, groups)

    text = report(args, device, groups, results)
    output = args.output or RESULTS_DIR / f"optimizer_step_{device.type}.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(text)
    print(f"report written to {output}")


if __name__ == "__main__":
    main()
