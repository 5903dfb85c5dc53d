"""The benchmark's processes: the calibration on every rank at once (no network), and each training,
one process per rank in its node's namespace (``benchmarks.cluster.launch``), with the machine's load
meanwhile."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster.launch import Command, rank_commands, run_all
from benchmarks.cluster.netns import EmulatedCluster
from benchmarks.cluster.worker import busy_share, host_cpu_jiffies
from benchmarks.time_to_quality.methods import METHODS, NODES, RANKS_PER_NODE, Job, method_args
from benchmarks.time_to_quality.settings import Settings
from recipes.translation.compare import curve

CALIBRATE = "benchmarks.time_to_quality.calibrate"
FAILURE_CHARS = 4000
"""How much of a failed training's message (and its rank's log tail) the report keeps."""


def calibrate(settings: Settings, logs: Path) -> dict[str, Any]:
    """Run the calibration on every rank at once; return the inputs the model and the rate need."""
    world = NODES * RANKS_PER_NODE
    base = {
        "preset": settings.preset,
        "overrides": settings.recipe_overrides(),
        "world_size": world,
        "local_world_size": RANKS_PER_NODE,
        "warmup": settings.calibration_warmup,
        "steps": settings.calibration_steps,
    }
    commands = []
    for rank in range(world):
        spec = {**base, "rank": rank, "out": str(logs / f"calibrate{rank}.json")}
        argv = (sys.executable, "-m", CALIBRATE, json.dumps(spec))
        commands.append(Command(argv, logs / f"calibrate.rank{rank}.log", {}))
    run_all(commands, settings.timeout_s, "calibration")
    ranks = [json.loads((logs / f"calibrate{rank}.json").read_text()) for rank in range(world)]
    return summarize_calibration(ranks)


def summarize_calibration(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """C is the mean over steps of the slowest rank's forward + backward (the ranks wait for each
    other every step or two); the update times are means over ranks and steps."""
    per_step = [
        [f + b for f, b in zip(r["per_step"]["forward_s"], r["per_step"]["backward_s"], strict=True)]
        for r in ranks
    ]
    slowest = [max(values) for values in zip(*per_step, strict=True)]
    mean_compute = statistics.mean(r["compute_s"] for r in ranks)
    sizes = {r["param_bytes"] for r in ranks}
    if len(sizes) != 1:
        raise RuntimeError(f"the ranks built models of different sizes: {sorted(sizes)} bytes")
    return {
        "compute_s": statistics.mean(slowest),
        "compute_mean_s": mean_compute,
        "forward_fraction": statistics.mean(r["forward_s"] for r in ranks) / mean_compute,
        "adamw_s": statistics.mean(r["adamw_s"] for r in ranks),
        "decentralized_s": statistics.mean(r["decentralized_s"] for r in ranks),
        "param_bytes": ranks[0]["param_bytes"],
        "params": ranks[0]["params"],
        "test": ranks[0]["test"],
        "ranks": ranks,
    }


class LoadMeter:
    """The machine's load while a training runs: the share of CPU time busy (``/proc/stat``) and the
    1-minute load average (``os.getloadavg``) sampled every ``interval_s`` seconds, from ``with``'s
    start to its end. Other jobs on the cores show as a load above the ranks' own."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._jiffies = (0, 0)
        self.result: dict[str, float] = {}

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadMeter:
        self.samples.append(os.getloadavg()[0])
        self._jiffies = host_cpu_jiffies()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        self.result = {
            "cpu_busy_share": round(busy_share(self._jiffies, host_cpu_jiffies()), 3),
            "loadavg_1min_mean": round(statistics.fmean(self.samples), 2),
            "loadavg_1min_max": round(max(self.samples), 2),
            "loadavg_samples": len(self.samples),
        }


def train(
    cluster: EmulatedCluster,
    job: Job,
    settings: Settings,
    run: Path,
    logs: Path,
    warmup: int,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Train ``job`` with one process per rank in its node's namespace, ``settings.steps`` steps or,
    with ``budget_s``, for that many seconds of training (:meth:`Settings.run_settings`); return its
    command, wall seconds, validation curve, the bytes that crossed the node links per step and the
    machine's load meanwhile. A training that
    fails (a rank's exit code, a hang past ``--timeout``) returns the same with ``failed``: what
    :func:`~benchmarks.cluster.launch.run_all` said, the failed rank's log tail included; the
    benchmark goes on with the next one."""
    lr = job.lr if settings.lrs else None
    argv = [
        sys.executable, "-u", *method_args(job.method, settings.best, warmup), "--preset", settings.preset,
        *settings.recipe_overrides(), *settings.run_settings(job.seed, lr, budget_s),
        f"train.output_dir={run}",
    ]  # fmt: skip
    world = NODES * RANKS_PER_NODE
    name = run.name
    before = cluster.link_bytes()
    begin = time.monotonic()
    failure = None
    with LoadMeter() as load:
        commands = rank_commands(cluster, argv, RANKS_PER_NODE, logs, name)
        try:
            run_all(commands, settings.timeout_s, name, echo=True)
        except RuntimeError as error:
            failure = str(error)[-FAILURE_CHARS:]
    wall = time.monotonic() - begin
    after = cluster.link_bytes()
    sent = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))  # node -> switch, every node
    points = curve(run)
    steps = points[-1]["step"] if points else settings.steps  # where it stopped (a budget: its own)
    result = {
        "method": job.method,
        "seed": job.seed,
        "lr": job.lr,
        "is_default": METHODS[job.method].is_default,
        "label": METHODS[job.method].label,
        "steps": steps,
        "budget_s": budget_s,
        "train_command": shlex.join(argv),
        "wall_seconds": round(wall, 1),
        "inter_node_bytes_per_step": sent / (world * steps),
        "load": load.result,
        "curve": points,
    }
    if failure is not None:
        result["failed"] = failure
    return result
