"""Pieces of a recipe's training loop that mean the same in every recipe.

Training time (``train_seconds`` in ``metrics.jsonl``, the time-based stop, items per second) is
the wall time of the training loop minus its logging, evaluations and checkpoints: it includes
waiting for data (reading, decoding, collating the next batches), the forward and backward passes
and the optimizer step with the communication it waits for. :class:`TrainingClock` measures it;
the loop starts the clock before it asks for its batches and stops it after the optimizer step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from recipes.common.config import check_choice

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["PRECISIONS", "TrainingClock", "mixed_precision", "out_of_time"]

PRECISIONS = ("auto", "no", "bf16", "fp16")


def mixed_precision(setting: str) -> str:
    """What ``Accelerator(mixed_precision=...)`` gets: ``auto`` is bf16 on a GPU that has it, else no."""
    check_choice("train.mixed_precision", setting, PRECISIONS)
    if setting != "auto":
        return setting
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


class TrainingClock:
    """Training seconds: ``start()`` before the loop asks for data, ``stop()`` after the optimizer step.

    ``seconds`` is the total over the run, ``resumed`` from a checkpoint; time between a ``stop()``
    and the next ``start()`` (logging, evaluation, saving) is not counted.
    """

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> float:
        """Add the time since ``start()``; return the total."""
        if self._since is None:
            raise RuntimeError("TrainingClock.stop() without start()")
        self.seconds += time.perf_counter() - self._since
        self._since = None
        return self.seconds


def out_of_time(accelerator: Accelerator, seconds: float, max_minutes: float) -> bool:
    """Whether any rank has trained ``max_minutes`` (0: no limit): a collective, so every rank stops at
    the same step; call it at the same steps on every rank."""
    if max_minutes <= 0:
        return False
    flag = torch.tensor([float(seconds >= 60 * max_minutes)], device=accelerator.device)
    return bool(accelerator.gather(flag).max() > 0)
