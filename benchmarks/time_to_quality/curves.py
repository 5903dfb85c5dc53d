"""What the runs' validation curves say: steady ms per iteration, the time (and steps) to reach a
validation loss, every method against All-Reduce at each of its evaluated losses, and the goals."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.thresholds import MODEL_TOLERANCE, TTQ_BLEU_GAP, TTQ_TIME_RATIO
from benchmarks.time_to_quality.methods import BASELINE, METHODS
from recipes.translation.compare import time_to_reach

__all__ = ["comm_wait_ms", "levels", "ratio", "steady_ms_per_iter", "time_to_reach"]


def steady_ms_per_iter(points: Sequence[dict[str, float]]) -> float | None:
    """ms per iteration between the first and the last evaluation (the first interval is warm-up);
    with one evaluation, over the whole run."""
    if not points:
        return None
    first, last = points[0], points[-1]
    if len(points) == 1 or last["step"] == first["step"]:
        return 1e3 * last["train_seconds"] / last["step"]
    return 1e3 * (last["train_seconds"] - first["train_seconds"]) / (last["step"] - first["step"])


def comm_wait_ms(run: Path) -> float | None:
    """Mean time a rank blocked per step waiting for its exchanges (the recipe's
    ``decentadam/comm_wait_ms``, logged to TensorBoard every ``log_every`` steps as a mean over ranks),
    over a run's log windows; None for a run without it (All-Reduce)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: list[float] = []
    for events in sorted((run / "tb").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "decentadam/comm_wait_ms" in accumulator.Tags()["scalars"]:
            values += [event.value for event in accumulator.Scalars("decentadam/comm_wait_ms")]
    return statistics.fmean(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def levels(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Time and steps each method takes to reach each of All-Reduce's evaluated validation losses.

    A method's time ratio to All-Reduce at a level is its steps ratio (how many more optimizer steps
    it needs for that loss) times its time-per-step ratio (what the network costs it), which is how
    the report separates the optimizer's part from the network's. Empty without an All-Reduce run.
    """
    baseline = runs.get(BASELINE)
    if baseline is None:
        return []
    rows = []
    for point in baseline["curve"]:
        target = point["valid_nll"]
        row: dict[str, Any] = {
            "step": point["step"],
            "valid_nll": target,
            "train_seconds": point["train_seconds"],
            "methods": {},
        }
        for name, run in runs.items():
            seconds = time_to_reach(run["curve"], target)
            steps = time_to_reach(run["curve"], target, key="step")
            row["methods"][name] = {
                "seconds": seconds,
                "steps": steps,
                "time_ratio": ratio(seconds, point["train_seconds"]),
                "steps_ratio": ratio(steps, point["step"]),
            }
        rows.append(row)
    return rows


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """Add what the runs' curves and predictions imply: steady ms per iteration, time to All-Reduce's
    final validation loss, ratios to All-Reduce, and the goals. Returns ``report`` (changed in place)."""
    runs: dict[str, dict[str, Any]] = report["runs"]
    baseline = runs.get(BASELINE)
    target = baseline["curve"][-1]["valid_nll"] if baseline and baseline["curve"] else None
    report["target_valid_nll"] = target
    for run in runs.values():
        points = run["curve"]
        run["ms_per_iter"] = steady_ms_per_iter(points)
        run["train_seconds"] = points[-1]["train_seconds"] if points else None
        run["final_valid_nll"] = points[-1]["valid_nll"] if points else None
        run["time_to_target_s"] = time_to_reach(points, target) if target is not None else None
    if baseline is not None:
        for run in runs.values():
            run["time_ratio"] = ratio(run["time_to_target_s"], baseline["time_to_target_s"])
            run["iter_ratio"] = ratio(run["ms_per_iter"], baseline["ms_per_iter"])
            predicted = run.get("predicted")
            base_predicted = baseline.get("predicted")
            run["predicted_iter_ratio"] = (
                ratio(predicted["iteration_ms"], base_predicted["iteration_ms"])
                if predicted and base_predicted
                else None
            )
    report["levels"] = levels(runs)
    report["goals"] = goals(runs)
    return report


def goals(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The checks of each judged method (``aer``, ``aer-node``, ``complete-node-bf16``: those at
    ``aer``'s inter-node bytes; ``complete-node-bf16-shared`` and ``-shared-sync`` at 1.5x them, the
    library's options on the nodes) against All-Reduce (benchmarks.thresholds; empty without
    All-Reduce's run)."""
    base = runs.get(BASELINE)
    if base is None:
        return []
    found = []
    for name, run in runs.items():
        method = METHODS.get(name)
        if method is not None and method.judged:
            found += _goals_of(method.label, run, base)
    return found


def _goals_of(label: str, run: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    time_ratio = run.get("time_ratio")
    found.append(
        {
            "goal": f"{label}: reaches All-Reduce's final validation loss in <= {TTQ_TIME_RATIO:g}x its time",
            "measured": "not reached" if time_ratio is None else f"{time_ratio:.2f}x",
            "met": time_ratio is not None and time_ratio <= TTQ_TIME_RATIO,
        }
    )
    if run.get("bleu") is not None and base.get("bleu") is not None:
        gap = base["bleu"] - run["bleu"]
        seconds = ratio(run.get("train_seconds"), base.get("train_seconds"))
        within = seconds is not None and seconds <= 1.0
        found.append(
            {
                "goal": f"{label}: BLEU within {TTQ_BLEU_GAP:g} of All-Reduce's in no more training time",
                "measured": f"{run['bleu']:.2f} vs {base['bleu']:.2f} ({run['bleu'] - base['bleu']:+.2f})"
                + ("" if seconds is None else f" after {seconds:.2f}x its training time"),
                "met": gap <= TTQ_BLEU_GAP and within,
            }
        )
    measured, predicted = run.get("iter_ratio"), run.get("predicted_iter_ratio")
    if measured is not None and predicted is not None:
        error = predicted / measured - 1
        found.append(
            {
                "goal": f"{label}: the runtime model's ratio of its iteration to All-Reduce's within "
                f"{MODEL_TOLERANCE:.0%} of the measured one",
                "measured": f"predicted {predicted:.2f}, measured {measured:.2f} ({error:+.0%})",
                "met": abs(error) <= MODEL_TOLERANCE,
            }
        )
    return found
