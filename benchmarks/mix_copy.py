"""Time what DecentralizedAdam.step() costs besides the Adam arithmetic: mixing and the send-buffer copy.

Run from the repository root::

    python benchmarks/mix_copy.py                       # CUDA when available, else CPU
    python benchmarks/mix_copy.py --device cpu --param-mb 100

It runs the real ``DecentralizedAdam.step()`` on S MB of float32 parameters in 8 tensors (the
cluster benchmark's model), in groups of 2 (``complete`` over 2 ranks), with 25 MB buckets. The
exchange is a communicator whose sum is already there, and the Adam update is switched off, so a
step is exactly: wait (nothing to wait for), ``param = group sum / 2`` per tensor, copy the parameters
into the send buffer, start the exchange. This is the "update" time the cluster report measures for
decentadam, less the optimizer arithmetic it emulates. The report goes to
``benchmarks/results/mix_copy_<device>.md``.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from decentadam import AllRanks, Comm, DecentralizedAdam, Setting
from decentadam.topology import Group

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class _Arrived:
    def wait(self, timeout: timedelta = timedelta(0)) -> object:
        return True


class ArrivedCommunicator:
    """Rank 0 of 2 ranks whose group sums are already in the buffer: no network, no waiting."""

    rank = 0
    world_size = 2

    def group_sum(self, tensor: Tensor, group: Group) -> _Arrived:
        return _Arrived()

    def world_sum(self, tensor: Tensor) -> None:
        return None

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        return None


def _no_update(state: Any, group: Any, params: Any, source: Any) -> None:
    return None


def time_steps(device: str, param_mb: float, steps: int) -> list[float]:
    elements = int(param_mb * 1e6) // 4
    params = [torch.nn.Parameter(torch.randn(elements // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = DecentralizedAdam(
        params,
        # benchmarks.gossip.plain, written out: this script runs as a file, outside the package
        setting=Setting(
            topology="complete",
            exchange="parameters",
            average_every=0,
            intra_node="gossip",
            second_moment=AllRanks(),
        ),
        # the Adam arithmetic, off
        comm=Comm(communicator=ArrivedCommunicator(), bucket_size_mb=25.0, local_update=_no_update),
    )
    seconds = []
    for index in range(steps + 5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 5:  # warm-up
            seconds.append(time.perf_counter() - start)
    return seconds


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads"
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--param-mb", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--output", type=Path, default=None, help="report path (default: results/...)")
    args = parser.parse_args(argv)
    seconds = time_steps(args.device, args.param_mb, args.steps)
    name = torch.cuda.get_device_name() if args.device == "cuda" else _cpu_name()
    median, p90 = statistics.median(seconds), sorted(seconds)[int(0.9 * (len(seconds) - 1))]
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/mix_copy.py", *sys.argv[1:]])
    lines = [
        f"# DecentralizedAdam mixing + send-buffer copy, {args.param_mb:g} MB, {args.device}",
        "",
        f"- command: `{command}`",
        f"- device: {name}; torch {torch.__version__}; "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- {args.steps} timed steps after 5 warm-up steps; Adam arithmetic off (see the script's docstring)",
        "",
        "| median ms per step | p90 ms | mean ms |",
        "|---:|---:|---:|",
        f"| {median * 1e3:.3f} | {p90 * 1e3:.3f} | {statistics.mean(seconds) * 1e3:.3f} |",
        "",
    ]
    output = args.output or RESULTS_DIR / f"mix_copy_{args.device}.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
