"""Soak: tens of thousands of exchanges on 4 gloo ranks; threads, open files, memory and process
groups must stay flat.

Run from the repository root (on a shared machine, under its CPU lock)::

    OMP_NUM_THREADS=1 flock /tmp/decentadam-cpu.lock .venv/bin/python -m benchmarks.soak
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak --steps 400 --sample-every 50 --out /tmp/soak

Each mode trains a small MLP (32 -> 64 -> 8, 2,632 parameters, one bucket) on a fixed batch per
rank, 4 ranks emulating 2 nodes x 2 (``local_world_size=2``), for ``--steps`` steps:

- ``aer-step``: :class:`decentadam.DecentralizedAdam` on ``aer`` with ``overlap="step"``: one
  exchange per step, alternately inside a node (2 ranks) and across the node pair (4 ranks, summed
  in three phases by the communicator's driver thread);
- ``aer-backward``: the same with ``overlap="backward"`` (exchanges start from backward hooks);
- ``a2cid2``: :class:`decentadam.A2CiD2` around SGD on a ring, one averaging per step on average
  (``--a2cid2-step-ms`` of emulated compute per step, so that the pairing thread keeps up).

Every ``--sample-every`` steps each rank records its operating-system threads
(``/proc/self/task``), Python threads, open file descriptors (``/proc/self/fd``), resident memory
(``VmRSS``), torch.distributed's process groups (``get_pg_count``) and the exchanges it has taken
part in; also once before the optimizer is built and once after ``close()``. The sample at
``--warmup`` steps is the reference: afterwards threads, descriptors and process groups must not
change at all, and resident memory must not grow by more than ``--rss-bound-mib``; after ``close()``
threads, descriptors and process groups must be back where they were before the optimizer was built.
:func:`check` says which bound a run broke.

Writes ``benchmarks/results/soak.{json,md}`` (``--out`` to change): the JSON holds every sample and
the machine; the report is made from the JSON alone, so that ``python -m benchmarks.soak --check
benchmarks/results/soak.json`` runs today's :func:`check` on a committed run and writes its report
again (exit code 1 if a bound is broken or the verdict differs from the one recorded).
"""

from __future__ import annotations

if not __package__:  # run as a file: the `benchmarks` package would not be importable
    raise SystemExit(
        f"{__file__} is a module of the benchmarks package: run python -m benchmarks.soak "
        "from the repository root"
    )

import argparse
import datetime
import gc
import json
import os
import queue
import shlex
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.a2cid2_straggler import free_port  # the same loopback launch
from benchmarks.gossip import plain
from benchmarks.machine import machine
from decentadam import A2CiD2, Comm, DecentralizedAdam

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("aer-step", "aer-backward", "a2cid2")
WORLD_SIZE, LOCAL_WORLD_SIZE = 4, 2
METRICS = ("os_threads", "python_threads", "fds", "process_groups")  # must not change after warm-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=21_000, help="training steps of the aer modes")
    parser.add_argument("--a2cid2-steps", type=int, default=90_000, help="training steps of a2cid2")
    parser.add_argument("--sample-every", type=int, default=1_000)
    parser.add_argument("--warmup", type=int, default=1_000, help="the reference sample's step")
    parser.add_argument("--rss-bound-mib", type=float, default=4.0, help="allowed RSS growth after warm-up")
    parser.add_argument("--a2cid2-step-ms", type=float, default=1.0, help="emulated compute per A2CiD2 step")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = parser.parse_args(argv)
    if args.warmup % args.sample_every or not 0 < args.warmup < min(args.steps, args.a2cid2_steps):
        parser.error("--warmup must be a multiple of --sample-every and below the steps of every mode")
    return args


# ---------------------------------------------------------------------------- one rank


def live_process_groups() -> int:
    """The process groups torch.distributed holds now, the default one included.

    ``get_pg_count()`` counts every group ever created, destroyed ones too; the live ones are the
    keys of torch's own registry (a private attribute: there is no public count of them).
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    registry = getattr(world, "pg_map", None)
    if registry is None:
        raise RuntimeError(
            f"torch {torch.__version__} keeps its process groups elsewhere: update live_process_groups"
        )
    return len(registry)


def open_files() -> dict[str, int]:
    """This process's open file descriptors, by kind (socket, pipe, anon_inode, file, ...)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor of the listing itself, closed meanwhile
            continue
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def sample(step: int, exchanges: int) -> dict[str, Any]:
    """This process's resources now."""
    status = Path("/proc/self/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    files = open_files()
    return {
        "step": step,
        "exchanges": exchanges,
        "time": time.monotonic(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "fds": sum(files.values()),
        "fd_kinds": files,
        "process_groups": live_process_groups(),
        "rss_mib": rss_kib / 1024,
    }


def soak(rank: int, mode: str, steps: int, sample_every: int, a2cid2_step_ms: float) -> dict[str, Any]:
    """Train ``steps`` steps in ``mode``; the samples of this rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
    before = sample(0, 0)
    optimizer: DecentralizedAdam | A2CiD2
    if mode == "a2cid2":
        local = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        optimizer = A2CiD2(local, graph="ring", rate=1.0, seed=0, timeout=60)
        pause = a2cid2_step_ms / 1e3
    else:
        overlap: Literal["step", "backward"] = "backward" if mode == "aer-backward" else "step"
        optimizer = DecentralizedAdam(
            model.parameters(), lr=1e-3, setting=plain("aer"),
            comm=Comm(local_world_size=LOCAL_WORLD_SIZE, overlap=overlap, timeout=60),
        )  # fmt: skip
        pause = 0.0
    samples = [sample(0, 0)]
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
        if pause:
            time.sleep(pause)
        optimizer.step()
        if step % sample_every == 0:
            samples.append(sample(step, optimizer.stats.exchanges))
    exchanges = optimizer.stats.exchanges
    if mode != "a2cid2":
        # every rank has taken its last sample before any closes: a peer's close() shuts connections
        # to this rank, which a later sample would count as descriptors gone (seen on a loaded
        # machine: rank 0 one socket short at its last sample). A2CiD2's ranks step on their own
        # clocks and are not held here.
        dist.barrier()
    optimizer.close()
    closed = sample(steps, exchanges)
    del optimizer, model
    gc.collect()
    return {"before": before, "samples": samples, "closed": closed, "released": sample(steps, exchanges)}


def worker(rank: int, port: int, config: dict[str, Any], results: Any) -> None:
    """One rank: every mode in turn, in one process group."""
    try:
        os.environ["WORLD_SIZE"] = str(WORLD_SIZE)
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
        records = {}
        for mode in config["modes"]:
            steps = config["a2cid2_steps"] if mode == "a2cid2" else config["steps"]
            records[mode] = soak(rank, mode, steps, config["sample_every"], config["a2cid2_step_ms"])
            dist.barrier()  # every rank has let go of this mode's optimizer
        results.put((rank, "ok", json.dumps(records)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(config: dict[str, Any], timeout_s: float = 1800.0) -> dict[str, list[dict[str, Any]]]:
    """Soak ``config["modes"]`` on 4 spawned gloo processes; by mode, every rank's record."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=worker, args=(rank, port, config, results), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    records: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(records) < WORLD_SIZE:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in records
                ]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead or 'all'} died or hung without reporting") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            records[rank] = json.loads(value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return {mode: [records[rank][mode] for rank in range(WORLD_SIZE)] for mode in config["modes"]}


# ---------------------------------------------------------------------------- verdict and report


def kind_changes(reference: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    return {
        k: now.get(k, 0) - reference.get(k, 0)
        for k in sorted({*reference, *now})
        if now.get(k, 0) != reference.get(k, 0)
    }


def summarize(mode: str, records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per rank: the warm-up reference, every change after it, the RSS trend, and after close."""
    ranks = []
    for record in records:
        samples = record["samples"]
        reference = next(s for s in samples if s["step"] == warmup)
        later = [s for s in samples if s["step"] >= warmup]
        steps = [s["step"] for s in later]
        rss = [s["rss_mib"] for s in later]
        mean_step, mean_rss = sum(steps) / len(steps), sum(rss) / len(rss)
        spread = sum((x - mean_step) ** 2 for x in steps)
        slope = sum((x - mean_step) * (y - mean_rss) for x, y in zip(steps, rss, strict=True)) / spread
        before, closed, released = record["before"], record["closed"], record["released"]
        ranks.append({
            "at_warmup": {k: reference[k] for k in (*METRICS, "rss_mib")},
            "changes": {k: sorted({s[k] - reference[k] for s in later} - {0}) for k in METRICS},
            "fd_changes": [
                {"step": s["step"], "kinds": kind_changes(reference["fd_kinds"], s["fd_kinds"])}
                for s in later if s["fds"] != reference["fds"]
            ],
            "rss_growth_mib": max(rss) - reference["rss_mib"],
            "rss_end_minus_warmup_mib": rss[-1] - reference["rss_mib"],
            "rss_slope_mib_per_1000_steps": slope * 1000,
            "rss_series_mib": [[s["step"], round(s["rss_mib"], 3)] for s in samples],
            "exchanges": samples[-1]["exchanges"],
            "seconds": samples[-1]["time"] - samples[0]["time"],
            "before": {k: before[k] for k in METRICS},
            "closed": {k: closed[k] for k in METRICS},
            "closed_fd_kinds": kind_changes(before["fd_kinds"], closed["fd_kinds"]),
            "released": {k: released[k] for k in METRICS},
        })  # fmt: skip
    return {"mode": mode, "steps": records[0]["samples"][-1]["step"], "ranks": ranks}


def check(summary: dict[str, Any], rss_bound_mib: float) -> list[str]:
    """What broke the bounds (empty: none)."""
    problems = []
    for rank, row in enumerate(summary["ranks"]):
        where = f"{summary['mode']} rank {rank}"
        for metric, changes in row["changes"].items():
            if changes:
                problems.append(f"{where}: {metric} changed by {changes} after warm-up")
        if row["rss_growth_mib"] > rss_bound_mib:
            problems.append(
                f"{where}: RSS grew {row['rss_growth_mib']:.2f} MiB after warm-up (> {rss_bound_mib})"
            )
        for metric in METRICS:
            if row["closed"][metric] != row["before"][metric]:
                problems.append(
                    f"{where}: {metric} {row['closed'][metric]} after close(), "
                    f"{row['before'][metric]} before the optimizer was built"
                )
            if row["released"][metric] != row["before"][metric]:
                problems.append(
                    f"{where}: {metric} {row['released'][metric]} once the closed optimizer was dropped, "
                    f"{row['before'][metric]} before it was built"
                )
    return problems


def report(payload: dict[str, Any]) -> str:
    """The Markdown report of a soak's JSON (what :func:`main` writes), its verdict from :func:`check`."""
    summaries, host, wall_s = payload["summaries"], payload["machine"], payload["wall_s"]
    warmup, sample_every = int(payload["args"]["warmup"]), int(payload["args"]["sample_every"])
    rss_bound_mib = float(payload["args"]["rss_bound_mib"])
    lines = [
        "# Soak: resources over tens of thousands of exchanges (4 gloo ranks)",
        "",
        f"- command: `{payload['command']}`",
        f"- machine: {host['cpu']}, {host['cores']} cores; torch {host['torch']}; {host['date']}; load "
        f"average at the end {host['load']}; {wall_s:.0f} s in all",
        f"- bounds, from the warm-up sample (step {warmup:,}) on, sampled every {sample_every:,} "
        "steps: OS and Python threads, open file descriptors and process groups unchanged; RSS at most "
        f"{rss_bound_mib:g} MiB above the warm-up sample. Once the closed optimizer is dropped: "
        "threads, descriptors and process groups as before it was built",
        "",
        "| mode | rank | steps | exchanges | s | OS threads | Python threads | fds | process groups | "
        "RSS at warm-up (MiB) | RSS max growth (MiB) | RSS end - warm-up (MiB) | RSS trend (MiB / 1,000 "
        "steps) | threads, fds, groups: before / closed / dropped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for summary in summaries:
        for rank, row in enumerate(summary["ranks"]):
            warm = row["at_warmup"]

            def flat(metric: str, warm: dict[str, Any] = warm, row: dict[str, Any] = row) -> str:
                changes = row["changes"][metric]
                return f"{warm[metric]}" + (f" (changed by {changes})" if changes else "")

            def triple(state: dict[str, Any]) -> str:
                return f"{state['os_threads']}, {state['fds']}, {state['process_groups']}"

            lines.append(
                f"| {summary['mode']} | {rank} | {summary['steps']:,} | {row['exchanges']:,} | "
                f"{row['seconds']:.0f} | {flat('os_threads')} | {flat('python_threads')} | {flat('fds')} | "
                f"{flat('process_groups')} | {warm['rss_mib']:.1f} | {row['rss_growth_mib']:.2f} | "
                f"{row['rss_end_minus_warmup_mib']:+.2f} | {row['rss_slope_mib_per_1000_steps']:+.3f} | "
                f"{triple(row['before'])} / {triple(row['closed'])} / {triple(row['released'])} |"
            )
    problems = problems_of(payload)
    lines += ["", "Verdict: " + ("every bound held." if not problems else "bounds broken:")]
    lines += [f"- {p}" for p in problems]
    fd_notes = [
        f"- {s['mode']} rank {rank}: at step {c['step']:,}, {c['kinds']}"
        for s in summaries for rank, row in enumerate(s["ranks"]) for c in row["fd_changes"]
    ]  # fmt: skip
    if fd_notes:
        lines += ["", "Descriptors that differed from the warm-up sample, by kind:", *fd_notes]
    lingering = {
        (
            s["mode"],
            json.dumps(row["closed_fd_kinds"]),
            row["closed"]["os_threads"] - row["before"]["os_threads"],
        )
        for s in summaries
        for row in s["ranks"]
        if row["closed"] != row["before"]
    }
    if lingering:
        lines += ["", "Held after `close()` while the optimizer object is still referenced (per rank):"]
        lines += [
            f"- {mode}: {threads:+d} OS threads, descriptors {kinds}"
            for mode, kinds, threads in sorted(lingering)
        ]
    lines += [
        "",
        "Exchanges: the exchanges this rank took part in (DecentralizedAdam: one per step; A2CiD2: its "
        "pairwise averagings). RSS trend: least-squares slope of RSS over the samples from the warm-up "
        "on. Process groups: those torch.distributed holds, the default group included. Before / closed / "
        "dropped: before the optimizer was built, after its `close()`, and once the closed optimizer and "
        "its model were dropped (garbage-collected).",
    ]
    return "\n".join(lines) + "\n"


def problems_of(payload: dict[str, Any]) -> list[str]:
    """:func:`check` of every mode of a soak's JSON, with the RSS bound it ran under."""
    bound = float(payload["args"]["rss_bound_mib"])
    return [p for summary in payload["summaries"] for p in check(summary, bound)]


def recheck(path: Path) -> int:
    """``--check FILE``: the verdict of today's :func:`check` on a soak's JSON, and its report
    written again beside it (``FILE`` with ``.md``); 1 if a bound is broken or the JSON's own
    ``problems`` disagree."""
    payload = json.loads(path.read_text())
    problems = problems_of(payload)
    path.with_suffix(".md").write_text(report(payload))
    for problem in problems:
        print(problem)
    if problems != payload["problems"]:
        print(f"{path}: its problems {payload['problems']} differ from today's check {problems}")
        return 1
    print(f"{path}: {'every bound held' if not problems else f'{len(problems)} bounds broken'}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--check"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m benchmarks.soak --check RESULTS.json")
        return recheck(Path(argv[1]))
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.soak", *argv])
    config = {
        "modes": args.modes,
        "steps": args.steps,
        "a2cid2_steps": args.a2cid2_steps,
        "sample_every": args.sample_every,
        "a2cid2_step_ms": args.a2cid2_step_ms,
    }
    start = time.monotonic()
    summaries = [summarize(mode, records, args.warmup) for mode, records in run(config).items()]
    wall = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "command": command, "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "machine": machine(), "summaries": summaries, "problems": [], "wall_s": wall,
    }  # fmt: skip
    problems = payload["problems"] = problems_of(payload)
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    text = report(payload)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
