"""Time to a target training loss with one straggler: All-Reduce SGD, synchronous gossip,
asynchronous gossip, and A2CiD2, on gloo processes over loopback.

Run from the repository root (one CPU core per two processes is enough: compute is emulated)::

    OMP_NUM_THREADS=1 python benchmarks/a2cid2_straggler.py                     # 4 and 8 ranks, 2 seeds
    OMP_NUM_THREADS=1 python benchmarks/a2cid2_straggler.py --world-sizes 4 --seeds 1 --seconds 8
    OMP_NUM_THREADS=1 python benchmarks/a2cid2_straggler.py --straggler 1 \\
        --out benchmarks/results/a2cid2_no_straggler                          # the control

The workload is noisy linear regression (256 features with a decaying spectrum, 8 outputs, 8,192
samples, the same data set on every rank, each rank drawing its own batches of 32, as in the
paper's asynchronous runs), trained with SGD, momentum 0.9, lr 0.1. A gradient step takes
``--step-ms`` (10 ms) of emulated compute on every rank but the last, which takes
``--straggler`` (3) times longer: a sleep, so that 8 processes fit on 2 cores and the step times
are what the flags say. Every method trains for ``--seconds`` of wall-clock time:

- ``allreduce``: gradients all-reduced (averaged) every step, then the SGD step on every rank;
- ``sync-gossip``: :class:`decentadam.DecentralizedAdam` on the ``ring`` topology with an SGD
  momentum update in place of AccumAdamW (``local_update=``): one neighbour per step, alternately
  left and right, exchange overlapping the next step;
- ``async-gossip``: :class:`decentadam.A2CiD2` with ``continuized=False``: pairwise averagings
  with ring neighbours, one per gradient step on average, beside steps that never wait;
- ``a2cid2``: the same with the continuized momentum.

Every ``--eval-every`` of its own steps, each rank records the loss of its *own* parameters on 2,048
training samples, with the time. The training loss at time ``t`` is the mean over ranks of each
rank's latest record (for the synchronous methods, where all ranks take the same steps, this is
the loss of their models at their common step). Time to target is the first ``t`` (on a 50 ms
grid) where it falls to ``--target`` (default 0.45, against a noise floor of 0.36). The ranks'
step counts in the budget show who was held back. Compute is a sleep and the model is 8 KB, so
communication costs next to nothing here: the comparison isolates the straggler.

Writes ``benchmarks/results/a2cid2_straggler.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from decentadam import A2CiD2, AllRanks, Comm, DecentralizedAdam, Setting

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("allreduce", "sync-gossip", "async-gossip", "a2cid2")
FEATURES, OUTPUTS, SAMPLES, EVAL_SAMPLES, BATCH, NOISE = 256, 8, 8192, 2048, 32, 0.3
LR, MOMENTUM = 0.1, 0.9
SYNC_STOP_EVERY = 10  # synchronous methods agree every 10 steps whether time is up (a tiny all-reduce)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", type=int, default=2, help="runs per method and world size")
    parser.add_argument("--seconds", type=float, default=20.0, help="wall-clock training budget per run")
    parser.add_argument("--step-ms", type=float, default=10.0, help="emulated compute per step, fast ranks")
    parser.add_argument("--straggler", type=float, default=3.0, help="the last rank's slow-down factor")
    parser.add_argument("--rate", type=float, default=1.0, help="asynchronous averagings per step")
    parser.add_argument("--target", type=float, default=0.45, help="training loss to reach")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between loss records")
    parser.add_argument("--out", type=Path, default=RESULTS / "a2cid2_straggler")
    return parser.parse_args(argv)


def dataset() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    scale = (torch.arange(FEATURES) + 1.0) ** -0.5  # a decaying spectrum: many steps to converge
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator) * scale
    truth = torch.randn(FEATURES, OUTPUTS, generator=generator)
    targets = inputs @ truth + NOISE * torch.randn(SAMPLES, OUTPUTS, generator=generator)
    return inputs, targets


def sgd_momentum(
    state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor], source: Any
) -> None:
    """DecentralizedAdam's local update replaced by SGD with momentum (as torch.optim.SGD)."""
    for p in params:
        assert p.grad is not None
        buffer = state[p].get("momentum_buffer")
        if buffer is None:
            buffer = state[p]["momentum_buffer"] = p.grad.detach().clone()
        else:
            buffer.mul_(MOMENTUM).add_(p.grad)
        p.add_(buffer, alpha=-group["lr"])


def worker(
    rank: int, world_size: int, port: int, method: str, seed: int, args: dict[str, Any], out: Any
) -> None:
    try:
        os.environ["WORLD_SIZE"] = str(world_size)
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
        result = train(rank, world_size, method, seed, args)
        payload = io.BytesIO()
        torch.save(result, payload)
        out.put((rank, "ok", payload.getvalue()))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(rank: int, world_size: int, method: str, seed: int, args: dict[str, Any]) -> dict[str, Any]:
    inputs, targets = dataset()
    eval_inputs, eval_targets = inputs[:EVAL_SAMPLES], targets[:EVAL_SAMPLES]
    weight = torch.nn.Parameter(torch.zeros(FEATURES, OUTPUTS))
    batches = torch.Generator().manual_seed(1000 * seed + rank)  # every rank its own batches
    step_seconds = args["step_ms"] / 1e3 * (args["straggler"] if rank == world_size - 1 else 1.0)

    optimizer: Any
    if method == "allreduce":
        optimizer = torch.optim.SGD([weight], lr=LR, momentum=MOMENTUM)
    elif method == "sync-gossip":
        optimizer = DecentralizedAdam(
            [weight],
            lr=LR,
            # benchmarks.gossip.plain, written out: this script runs as a file, outside the package
            setting=Setting(
                topology="ring",
                exchange="parameters",
                average_every=0,
                intra_node="gossip",
                second_moment=AllRanks(),
            ),
            comm=Comm(local_update=sgd_momentum),
        )
    else:
        local = torch.optim.SGD([weight], lr=LR, momentum=MOMENTUM)
        optimizer = A2CiD2(
            local, graph="ring", rate=args["rate"], continuized=method == "a2cid2", seed=seed, timeout=60
        )
    synchronous = method in ("allreduce", "sync-gossip")

    def loss_of(w: Tensor, x: Tensor, y: Tensor) -> Tensor:
        return 0.5 * (x @ w - y).square().sum(dim=1).mean()

    records: list[tuple[float, float]] = []
    dist.barrier()
    start = time.monotonic()
    deadline = start + args["seconds"]
    records.append((0.0, float(loss_of(weight.detach(), eval_inputs, eval_targets))))
    steps = 0
    while True:
        if synchronous and steps % SYNC_STOP_EVERY == 0:
            flag = torch.tensor([1.0 if time.monotonic() >= deadline else 0.0])
            dist.all_reduce(flag)  # the ranks of a synchronous method stop at the same step
            if flag.item() > 0:
                break
        elif not synchronous and time.monotonic() >= deadline:
            break
        index = torch.randint(0, SAMPLES, (BATCH,), generator=batches)
        optimizer.zero_grad()
        loss = loss_of(weight, inputs[index], targets[index])
        loss.backward()  # type: ignore[no-untyped-call]
        time.sleep(step_seconds)  # the emulated rest of the forward/backward
        if method == "allreduce":
            assert weight.grad is not None
            dist.all_reduce(weight.grad)
            weight.grad.div_(world_size)
        optimizer.step()
        steps += 1
        if steps % args["eval_every"] == 0:
            with torch.no_grad():
                records.append((time.monotonic() - start, float(loss_of(weight, eval_inputs, eval_targets))))
    elapsed = time.monotonic() - start
    averagings, consensus = 0, 0.0
    if isinstance(optimizer, A2CiD2):
        averagings = optimizer.averagings
        consensus = optimizer.consensus_distance(relative=True)  # waits for the other ranks
        optimizer.close()  # then the exact average
    elif isinstance(optimizer, DecentralizedAdam):
        consensus = optimizer.consensus_distance(relative=True)
        optimizer.average_parameters(restore=False)
        optimizer.close()
    with torch.no_grad():
        final = float(loss_of(weight, eval_inputs, eval_targets))
    return {
        "steps": steps,
        "seconds": elapsed,
        "records": records,
        "averagings": averagings,
        "consensus": consensus,
        "final": final,
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(world_size: int, method: str, seed: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=worker, args=(rank, world_size, port, method, seed, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        while len(results) < world_size:
            rank, status, value = queue.get(timeout=args["seconds"] + 180)
            if status != "ok":
                raise RuntimeError(f"{method}, {world_size} ranks: rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]


def mean_curve(
    per_rank: list[dict[str, Any]], seconds: float, grid: float = 0.05
) -> list[tuple[float, float]]:
    """Mean over ranks of each rank's latest recorded loss, on a time grid."""
    curve = []
    for k in range(int(seconds / grid) + 1):
        t = k * grid
        latest = [[loss for when, loss in rank["records"] if when <= t][-1] for rank in per_rank]
        curve.append((t, sum(latest) / len(latest)))
    return curve


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for world_size in args.world_sizes:
        baseline = None
        for method in args.methods:
            mine = [r for r in runs if r["world_size"] == world_size and r["method"] == method]
            times = [r["time_to_target"] for r in mine]
            reached = [t for t in times if t is not None]
            median = statistics.median(reached) if len(reached) == len(times) else None
            if method == "allreduce":
                baseline = median
            steps = [statistics.mean(r["steps"][k] for r in mine) for k in range(world_size)]
            rows.append({
                "world_size": world_size,
                "method": method,
                "time_to_target_s": times,
                "median_s": median,
                "speedup_vs_allreduce": baseline / median if baseline and median else None,
                "fast_rank_steps": statistics.mean(steps[:-1]),
                "straggler_steps": steps[-1],
                "averagings_per_step": statistics.mean(
                    sum(r["averagings"]) / max(sum(r["steps"]), 1) for r in mine
                ),
                "final_consensus_loss": statistics.mean(r["final"] for r in mine),
                "consensus_distance_rel": statistics.mean(r["consensus"] for r in mine),
            })  # fmt: skip
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.machine(),
    )  # fmt: skip
    lines = [
        "# Time to a target training loss "
        + ("with one straggler" if args.straggler != 1 else "without a straggler")
        + " (loopback gloo)",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu}, {os.cpu_count()} threads; torch {torch.__version__}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- workload: noisy linear regression, SGD momentum {MOMENTUM}, lr {LR}, batch {BATCH} per rank; "
        f"target training loss {args.target} (noise floor {0.5 * NOISE**2 * OUTPUTS:.2f}); "
        f"{args.seconds:g} s budget per run, {args.seeds} seeds",
        f"- ring of n ranks; emulated compute {args.step_ms:g} ms per step, the last rank "
        f"{args.straggler:g}x slower; asynchronous methods: {args.rate:g} averaging per step",
        "",
        "| n | method | time to target, median (s) | runs (s) | vs All-Reduce | steps per fast rank | "
        "steps of the last rank | averagings per step | consensus distance at the end | "
        "final consensus loss |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        median = f"{row['median_s']:.2f}" if row["median_s"] is not None else "not reached"
        runs = ", ".join("-" if t is None else f"{t:.2f}" for t in row["time_to_target_s"])
        speedup = f"{row['speedup_vs_allreduce']:.2f}x" if row["speedup_vs_allreduce"] else "-"
        averagings = (
            f"{row['averagings_per_step']:.2f}" if row["method"].endswith(("gossip", "a2cid2")) else "-"
        )
        if row["method"] == "sync-gossip":
            averagings = "1 (every step)"
        lines.append(
            f"| {row['world_size']} | {row['method']} | {median} | {runs} | {speedup} | "
            f"{row['fast_rank_steps']:.0f} | {row['straggler_steps']:.0f} | {averagings} | "
            f"{row['consensus_distance_rel']:.1e} | {row['final_consensus_loss']:.3f} |"
        )
    lines += [
        "",
        "Time to target: first time the mean over ranks of each rank's own training loss (2,048 samples) "
        "is at or below the target. Steps: gradient steps each rank took in the budget (mean over runs; "
        "the fast ranks' mean, then the last rank's). Averagings per step: pairwise averagings a rank "
        "took part in, per gradient step, over all ranks. Consensus distance: mean_i ||x_i - x_bar||^2 / "
        "||x_bar||^2 at the end of the budget, before the final average. Final consensus loss: the loss "
        "of the exact average of the ranks' parameters at the end.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    settings = {
        k: v for k, v in vars(args).items() if k in ("seconds", "step_ms", "straggler", "rate", "eval_every")
    }
    runs = []
    for world_size in args.world_sizes:
        for seed in range(args.seeds):
            for method in args.methods:
                per_rank = launch(world_size, method, seed, settings)
                curve = mean_curve(per_rank, max(r["seconds"] for r in per_rank))
                run = {
                    "world_size": world_size,
                    "method": method,
                    "seed": seed,
                    "time_to_target": time_to(curve, args.target),
                    "steps": [r["steps"] for r in per_rank],
                    "averagings": [r["averagings"] for r in per_rank],
                    "final": per_rank[0]["final"],
                    "consensus": per_rank[0]["consensus"],
                    "curve": curve[:: max(1, len(curve) // 120)],
                }
                runs.append(run)
                print(
                    f"n={world_size} seed={seed} {method:13s} "
                    f"time to {args.target}: {run['time_to_target']} s, steps {run['steps']}, "
                    f"averagings {run['averagings']}, consensus {run['consensus']:.2e}, "
                    f"final {run['final']:.4f}",
                    flush=True,
                )
    rows = summarize(runs, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "command": command,
        "settings": {**vars(args), "out": str(args.out)},
        "rows": rows,
        "runs": runs,
    }
    args.out.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(rows, args, command))
    print(report(rows, args, command))


if __name__ == "__main__":
    main()
