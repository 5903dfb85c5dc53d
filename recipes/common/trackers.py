"""Where a recipe's logged values go: ``train.report_to``, as Accelerate's trackers.

``tensorboard`` (the default) writes events under ``OUTPUT_DIR/tb/``; ``wandb`` logs to Weights &
Biases (project ``decentadam``, the run named after ``OUTPUT_DIR``, its files in
``OUTPUT_DIR/wandb/``); ``all`` is every tracker Accelerate finds installed; ``none`` logs to no
tracker (``metrics.jsonl`` and the progress lines still hold the numbers). :func:`trackers` is what
``Accelerator(log_with=...)`` and ``init_trackers(init_kwargs=...)`` get, :func:`tracker_config` the
effective configuration that ``init_trackers(config=...)`` records (TensorBoard's hparams, the
run's config on W&B), and :func:`where_logs_are` the line a run prints at its start.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

from recipes.common.config import ConfigError, check_choice

__all__ = ["PROJECT", "REPORT_TO", "check_report_to", "tracker_config", "trackers", "where_logs_are"]

REPORT_TO = ("tensorboard", "wandb", "all", "none")
PROJECT = "decentadam"
"""``init_trackers``' project name: the W&B project, and TensorBoard's folder under ``tb/``."""

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_report_to(report_to: str) -> None:
    """Raise ConfigError for an unknown ``train.report_to`` or a tracker that is not installed
    (Accelerate would drop it without a word)."""
    check_choice("train.report_to", report_to, REPORT_TO)
    package = _PACKAGES.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"train.report_to = {report_to!r}, but {package} is not installed: pip install {package}, "
            "or pass train.report_to=tensorboard (or none)"
        )


def trackers(report_to: str, run: Path) -> tuple[list[str] | None, dict[str, dict[str, Any]]]:
    """``Accelerator(log_with=...)`` and ``init_trackers(init_kwargs=...)`` for ``report_to`` and the
    run directory ``run`` (None: no tracker; Accelerate warns of an empty list)."""
    check_choice("train.report_to", report_to, REPORT_TO)
    log_with = None if report_to == "none" else [report_to]
    init_kwargs = (
        {"wandb": {"name": run.resolve().name, "dir": str(run)}} if report_to in ("wandb", "all") else {}
    )
    return log_with, init_kwargs


def tracker_config(config: Any, **more: int | float | str | bool) -> dict[str, int | float | str | bool]:
    """The dataclass ``config`` flattened to ``section.key`` scalars (lists as JSON text, unset
    options left out), with ``more`` (the world size, say): what every tracker can record."""
    flat: dict[str, int | float | str | bool] = {}
    for section in dataclasses.fields(config):
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            if value is None:
                continue
            scalar = isinstance(value, (int, float, str, bool))
            flat[f"{section.name}.{key}"] = value if scalar else json.dumps(list(value))
    return {**flat, **more}


def where_logs_are(report_to: str, run: Path) -> str:
    """The line a run prints at its start: its run directory and how to open its logs."""
    metrics = f"evaluations in {run / 'metrics.jsonl'}"
    if report_to == "none":
        return f"run directory {run}: no tracker (train.report_to=none); {metrics}"
    opened = {
        "tensorboard": f"open the logs with `tensorboard --logdir {run / 'tb'}`",
        "wandb": f"logs on Weights & Biases, project {PROJECT}, run {run.resolve().name} (its link is above)",
        "all": f"logs in every installed tracker (TensorBoard: `tensorboard --logdir {run / 'tb'}`)",
    }[report_to]
    return f"run directory {run}: {opened}; {metrics}"
