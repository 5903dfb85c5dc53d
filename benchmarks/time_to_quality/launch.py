"""The benchmark's processes: the calibration on every rank at once (no network), and each method's
training, one process per rank in its node's namespace (``benchmarks.cluster.launch``)."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster.launch import Command, rank_commands, run_all
from benchmarks.cluster.netns import EmulatedCluster
from benchmarks.time_to_quality.methods import NODES, RANKS_PER_NODE, Method
from benchmarks.time_to_quality.settings import Settings

TRAIN = "recipes.translation.train"
"""The recipe's module, started with ``python -m`` from the repository root."""
CALIBRATE = "benchmarks.time_to_quality.calibrate"


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


def train(
    cluster: EmulatedCluster, method: Method, settings: Settings, run: Path, logs: Path
) -> dict[str, Any]:
    """Train ``method`` with one process per rank in its node's namespace; return its command, wall
    seconds and the bytes that crossed the node links."""
    argv = [
        sys.executable, "-u", "-m", TRAIN, "--preset", settings.preset, *method.args,
        *settings.recipe_overrides(), *settings.run_settings(), f"train.output_dir={run}",
    ]  # fmt: skip
    world = NODES * RANKS_PER_NODE
    before = cluster.link_bytes()
    begin = time.monotonic()
    commands = rank_commands(cluster, argv, RANKS_PER_NODE, logs, method.name)
    run_all(commands, settings.timeout_s, method.name, echo=True)
    wall = time.monotonic() - begin
    after = cluster.link_bytes()
    sent = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))  # node -> switch, every node
    return {
        "label": method.label,
        "steps": settings.steps,
        "train_command": shlex.join(argv),
        "wall_seconds": round(wall, 1),
        "link_mb_per_rank_iter": sent / (world * settings.steps) / 1e6,
    }
