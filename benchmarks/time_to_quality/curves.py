"""What the runs' validation curves say: each run's steady ms per step, its time (and steps) to the
final validation loss of All-Reduce with the same seed, and per method the mean and each seed's value.

A run's time ratio to All-Reduce is its steps ratio (how many of All-Reduce's steps it needs for
that loss: the optimizer's part) times its time-per-step ratio (the network's part, with the
method's own computation), which is how the report separates the two.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.time_to_quality.methods import BASELINE
from recipes.translation.compare import time_to_reach

__all__ = ["analyse", "choose_rates", "mean", "ratio", "steady_ms_per_iter", "time_to_reach"]


def steady_ms_per_iter(points: Sequence[dict[str, float]]) -> float | None:
    """ms per iteration between the first and the last evaluation (the first interval is warm-up);
    with one evaluation, over the whole run."""
    if not points:
        return None
    first, last = points[0], points[-1]
    if len(points) == 1 or last["step"] == first["step"]:
        return 1e3 * last["train_seconds"] / last["step"]
    return 1e3 * (last["train_seconds"] - first["train_seconds"]) / (last["step"] - first["step"])


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def mean(values: Sequence[float | None]) -> float | None:
    """The mean, None when any value is missing (a seed that never reached the target) or none is given."""
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(v for v in values if v is not None)


def choose_rates(grid: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """From runs keyed ``METHOD/lr=X/seedN``: each method's rate with the lowest mean final validation
    loss over the seeds, and its runs keyed ``METHOD/seedN``."""
    finals: dict[tuple[str, float], list[float]] = {}
    for run in grid.values():
        finals.setdefault((run["method"], run["lr"]), []).append(run["curve"][-1]["valid_nll"])
    chosen: dict[str, float] = {}
    for method, lr in sorted(finals, key=lambda pair: statistics.fmean(finals[pair])):
        chosen.setdefault(method, lr)
    runs = {
        f"{run['method']}/seed{run['seed']}": run
        for run in grid.values()
        if chosen[run["method"]] == run["lr"]
    }
    return runs, chosen


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """Add to ``report`` (in place; returned) what the curves imply: per run its ms per step, final
    loss and time, steps and ratios to its seed's All-Reduce target; per method (``methods``) the
    means over seeds; ``goals`` and ``notes`` (:mod:`benchmarks.time_to_quality.notes`)."""
    from benchmarks.time_to_quality.notes import goals

    if report.get("grid"):
        report["runs"], report["chosen_lr"] = choose_rates(report["grid"])
    runs: dict[str, dict[str, Any]] = report["runs"]
    for run in runs.values():
        points = run["curve"]
        run["ms_per_iter"] = steady_ms_per_iter(points)
        run["train_seconds"] = points[-1]["train_seconds"] if points else None
        run["final_valid_nll"] = points[-1]["valid_nll"] if points else None
        run["final_step"] = points[-1]["step"] if points else None
    for run in runs.values():
        base = runs.get(f"{BASELINE}/seed{run['seed']}")
        if base is not None and "failed" in base:
            base = None  # its last evaluation is where it failed, not DDP's final loss: no target
        target = base["final_valid_nll"] if base else None
        run["target_valid_nll"] = target
        seconds = time_to_reach(run["curve"], target) if target is not None else None
        steps = time_to_reach(run["curve"], target, key="step") if target is not None else None
        run["time_to_target_s"], run["steps_to_target"] = seconds, steps
        run["time_ratio"] = ratio(seconds, base["train_seconds"]) if base else None
        run["steps_ratio"] = ratio(steps, base["final_step"]) if base else None
        run["per_step_ratio"] = ratio(run["time_ratio"], run["steps_ratio"])
        run["iter_ratio"] = ratio(run["ms_per_iter"], base["ms_per_iter"]) if base else None
    report["methods"] = summarize(runs)
    report["goals"] = goals(report["methods"])
    return report


FIELDS = (
    "time_to_target_s", "time_ratio", "steps_ratio", "per_step_ratio", "iter_ratio", "ms_per_iter",
    "final_valid_nll", "train_seconds", "bleu", "bleu_in_allreduce_time", "inter_node_bytes_per_step",
)  # fmt: skip
"""The per-run numbers the report gives per method as the mean over seeds and each seed's value."""


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method, in the order of first appearance: its seeds, and for each of :data:`FIELDS` the
    mean over seeds (None when a seed lacks it) and the values by seed."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for run in runs.values():
        by_method.setdefault(run["method"], []).append(run)
    out: dict[str, dict[str, Any]] = {}
    for method, members in by_method.items():
        members = sorted(members, key=lambda r: r["seed"])
        summary: dict[str, Any] = {
            "seeds": [r["seed"] for r in members],
            "is_default": bool(members[0].get("is_default")),
            "failed_seeds": [r["seed"] for r in members if "failed" in r],
        }
        for field in FIELDS:
            values = [r.get(field) for r in members]
            summary[field] = {"mean": mean(values), "by_seed": values}
        out[method] = summary
    return out
