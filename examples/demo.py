"""Quickstart demo: All-Reduce (DDP + AdamW) against DecentralizedAdam on 4 CPU processes.

Run from the repository root (``make demo`` does this inside .venv)::

    python examples/demo.py                      # 4 workers, topology "aer", 300 steps
    python examples/demo.py --topology ring --steps 200 --accum-steps 1

The script spawns its own gloo workers on 127.0.0.1 (no torchrun needed). Every worker trains the
same small MLP on its own synthetic regression data: inputs drawn with a per-rank seed, targets from
one shared, fixed "teacher" network plus noise. Two methods run one after the other on the same
data and the same initial weights:

(a) All-Reduce: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``;
(b) ``decentadam.DecentralizedAdam``: each worker keeps its own copy of the model, takes a local
    AccumAdamW step and averages parameters with its neighbours of the topology.

Every ``--log-every`` steps (and at the end) rank 0 prints the training loss (mean over ranks and
over the last logging window), the validation loss of the consensus-averaged model on a held-out
set, the consensus distance ``mean_i ||x_i - x_bar||^2`` (DecentralizedAdam only) and the median
milliseconds per training iteration on rank 0 so far. Four processes on a small machine share its
cores, so the timings show overheads on this machine, not the speed-up on a cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import decentadam
from decentadam import DecentralizedAdam

IN_FEATURES = 16
OUT_FEATURES = 4
HIDDEN = 128
TRAIN_SAMPLES_PER_RANK = 4096
VAL_SAMPLES = 4096
NOISE_STD = 0.1
TEACHER_SEED = 0
MODEL_SEED = 1
VAL_SEED = 2
DATA_SEED = 100  # rank r draws its training data with seed DATA_SEED + r


@dataclasses.dataclass(frozen=True)
class Config:
    """Command-line settings, shared by every worker."""

    steps: int
    workers: int
    topology: str
    local_world_size: int
    accum_steps: int
    lr: float
    batch_size: int
    log_every: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """What rank 0 reports for one method."""

    method: str
    first_val_loss: float
    train_loss: float
    val_loss: float
    consensus: float | None
    ms_per_iter: float
    wall_s: float


# ---------------------------------------------------------------------------------------- data


def make_teacher() -> nn.Module:
    """A fixed random network that defines the targets; the same on every rank."""
    generator = torch.Generator().manual_seed(TEACHER_SEED)
    teacher = nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.Tanh(), nn.Linear(64, OUT_FEATURES))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / max(1, p.shape[-1]) ** 0.5 * 1.5)
    return teacher.requires_grad_(False)


def make_data(teacher: nn.Module, samples: int, seed: int) -> tuple[Tensor, Tensor]:
    """``samples`` inputs drawn with ``seed`` and their noisy teacher targets."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, IN_FEATURES, generator=generator)  # (N, IN_FEATURES)
    y = teacher(x)  # (N, OUT_FEATURES)
    y = y + NOISE_STD * torch.randn(y.shape, generator=generator)
    return x, y


def make_model() -> nn.Module:
    """The student: the same initial weights on every rank and for both methods."""
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUT_FEATURES),
    )


@torch.no_grad()
def evaluate(model: nn.Module, val: tuple[Tensor, Tensor]) -> float:
    x, y = val
    return float(nn.functional.mse_loss(model(x), y).item())


# ---------------------------------------------------------------------------------------- training


def train(
    method: str,
    cfg: Config,
    rank: int,
    train_data: tuple[Tensor, Tensor],
    val: tuple[Tensor, Tensor],
) -> Summary | None:
    """Train one method on every rank; rank 0 prints progress and returns the summary."""
    model = make_model()
    optimizer: torch.optim.Optimizer
    decentralized: DecentralizedAdam | None = None
    if method == "all-reduce":
        forward: nn.Module = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    else:
        forward = model  # not wrapped: each rank keeps its own copy
        decentralized = DecentralizedAdam(
            model.parameters(),
            lr=cfg.lr,
            weight_decay=0.0,
            accum_steps=cfg.accum_steps,
            topology=cfg.topology,
            local_world_size=cfg.local_world_size,
        )
        optimizer = decentralized

    def consensus_val_loss() -> float:
        if decentralized is None:  # DDP keeps the copies identical: the model is the average
            return evaluate(model, val)
        with decentralized.average_parameters():
            return evaluate(model, val)

    x_train, y_train = train_data
    generator = torch.Generator().manual_seed(DATA_SEED + 1000 + rank)  # batch order, per rank
    first_val_loss = consensus_val_loss()
    iteration_ms: list[float] = []
    window_loss, window_steps = 0.0, 0
    train_loss = val_loss = float("nan")
    consensus: float | None = None
    label = "All-Reduce (DDP + AdamW)" if decentralized is None else f"DecentralizedAdam ({cfg.topology})"
    if rank == 0:
        header = f"{'step':>6} {'train loss':>11} {'val loss':>10} {'consensus':>10} {'ms/iter':>8}"
        print(f"\n== {label} ==\n{header}", flush=True)
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        index = torch.randint(0, x_train.shape[0], (cfg.batch_size,), generator=generator)
        x, y = x_train[index], y_train[index]  # (B, IN_FEATURES), (B, OUT_FEATURES)

        tic = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(forward(x), y)
        torch.autograd.backward(loss)  # loss.backward(); this form is typed for mypy --strict
        optimizer.step()
        iteration_ms.append((time.perf_counter() - tic) * 1e3)

        window_loss += float(loss.item())
        window_steps += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            totals = torch.tensor([window_loss, float(window_steps)], dtype=torch.float64)
            dist.all_reduce(totals)  # sums over ranks
            train_loss = float(totals[0] / totals[1])
            window_loss, window_steps = 0.0, 0
            val_loss = consensus_val_loss()
            consensus = decentralized.consensus_distance() if decentralized is not None else None
            if rank == 0:
                shown = f"{consensus:10.2e}" if consensus is not None else f"{'-':>10}"
                median = statistics.median(iteration_ms)
                print(f"{step:6d} {train_loss:11.4f} {val_loss:10.4f} {shown} {median:8.2f}", flush=True)
    wall_s = time.perf_counter() - start
    dist.barrier()
    if rank != 0:
        return None
    return Summary(
        method=label,
        first_val_loss=first_val_loss,
        train_loss=train_loss,
        val_loss=val_loss,
        consensus=consensus,
        ms_per_iter=statistics.median(iteration_ms),
        wall_s=wall_s,
    )


def worker(rank: int, cfg: Config, port: int, results: Any) -> None:
    """One process: join the gloo group, build the data, train both methods."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=cfg.workers,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        teacher = make_teacher()
        train_data = make_data(teacher, TRAIN_SAMPLES_PER_RANK, DATA_SEED + rank)
        val = make_data(teacher, VAL_SAMPLES, VAL_SEED)
        for method in ("all-reduce", "decentralized"):
            summary = train(method, cfg, rank, train_data, val)
            if summary is not None:
                results.put(dataclasses.asdict(summary))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- main


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_args() -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=300, help="training steps per method")
    parser.add_argument("--workers", type=int, default=4, help="number of CPU worker processes")
    parser.add_argument("--topology", default="aer", help="complete, ring, one-peer-exp or aer")
    parser.add_argument(
        "--local-world-size",
        type=int,
        default=2,
        help="ranks per emulated node for 'aer' (one machine would otherwise be a single node)",
    )
    parser.add_argument("--accum-steps", type=int, default=4, help="AccumAdamW window s")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate of both methods")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    args = parser.parse_args()
    if args.steps < 1 or args.workers < 1 or args.log_every < 1 or args.batch_size < 1:
        parser.error("--steps, --workers, --batch-size and --log-every must be >= 1")
    return Config(
        steps=args.steps,
        workers=args.workers,
        topology=args.topology,
        local_world_size=args.local_world_size,
        accum_steps=args.accum_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        log_every=args.log_every,
    )


def launch(cfg: Config) -> list[Summary]:
    """Run ``worker`` on ``cfg.workers`` fresh processes; return rank 0's summaries."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    processes = [ctx.Process(target=worker, args=(rank, cfg, port, results)) for rank in range(cfg.workers)]
    for process in processes:
        process.start()
    while any(p.exitcode is None for p in processes):
        if any(p.exitcode not in (None, 0) for p in processes):  # one failed: stop the others now
            for process in processes:
                process.terminate()
            break
        time.sleep(0.2)
    for process in processes:
        process.join()
    codes = [p.exitcode for p in processes]
    if any(code != 0 for code in codes):
        raise SystemExit(f"a worker failed (exit codes by rank: {codes}); see its traceback above")
    summaries = []
    while not results.empty():
        summaries.append(Summary(**results.get()))
    return summaries


def print_summary(summaries: list[Summary]) -> None:
    columns = f"{'method':<28} {'val loss (start -> end)':>24} {'train loss':>11} {'consensus':>10}"
    print(f"\n== summary ==\n{columns} {'ms/iter':>8} {'wall s':>7}")
    for s in summaries:
        shown = f"{s.consensus:10.2e}" if s.consensus is not None else f"{'-':>10}"
        losses = f"{s.first_val_loss:.4f} -> {s.val_loss:.4f}"
        print(
            f"{s.method:<28} {losses:>24} {s.train_loss:11.4f} {shown} {s.ms_per_iter:8.2f} {s.wall_s:7.1f}"
        )


def main() -> None:
    cfg = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers: one thread each
    os.environ.pop("WORLD_SIZE", None)  # the workers build their own process group
    print(
        f"decentadam {decentadam.__version__}, torch {torch.__version__}: {cfg.workers} workers "
        f"(gloo, CPU), {cfg.steps} steps, batch {cfg.batch_size} per worker, lr {cfg.lr}, "
        f"topology {cfg.topology!r} (local_world_size {cfg.local_world_size}), "
        f"accum_steps {cfg.accum_steps}",
        flush=True,
    )
    if cfg.workers > 1:
        try:
            topology = decentadam.build(cfg.topology, cfg.workers, cfg.local_world_size)
        except ValueError as error:
            raise SystemExit(f"demo.py: {error}") from None
        rounds = "; ".join(str(list(topology.groups(t))) for t in range(topology.period))
        print(
            f"{cfg.topology} rounds (period {topology.period}): {rounds}; "
            f"spectral gap {topology.spectral_gap():.3f}",
            flush=True,
        )
    start = time.perf_counter()
    summaries = launch(cfg)
    print_summary(summaries)
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
