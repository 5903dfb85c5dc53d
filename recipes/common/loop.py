"""Pieces of a recipe's training loop that mean the same in every recipe: the clock, the time limit,
and the loop's tail: evaluating the consensus model, logging a step, finishing the run (saving is
:meth:`recipes.common.run.RunDirectory.save`).

Training time (``train_seconds`` in ``metrics.jsonl``, the time-based stop, items per second) is
the wall time of the training loop minus its logging, evaluations and checkpoints: it includes
waiting for data (reading, decoding, collating the next batches), the forward and backward passes
and the optimizer step with the communication it waits for. :class:`TrainingClock` measures it;
the loop starts the clock before it asks for its batches and stops it after the optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from recipes.common.config import check_choice

if TYPE_CHECKING:
    from accelerate import Accelerator

    from decentadam import CommStats
    from recipes.common.progress import Progress

__all__ = [
    "PRECISIONS",
    "Parallel",
    "TrainingClock",
    "consensus",
    "finish",
    "log_step",
    "mixed_precision",
    "one_process_note",
    "out_of_time",
]

PRECISIONS = ("auto", "no", "bf16", "fp16")


def mixed_precision(setting: str) -> str:
    """What ``Accelerator(mixed_precision=...)`` gets: ``auto`` is bf16 on a GPU that has it, else no."""
    check_choice("train.mixed_precision", setting, PRECISIONS)
    if setting != "auto":
        return setting
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def one_process_note(module: str, o: Any, world: int) -> str | None:
    """What a decentralized run on one process trains (its local optimizer alone: nothing to average
    with) and how to launch several; None for several processes or All-Reduce. ``o`` is the resolved
    ``[optim]`` section."""
    if world > 1 or o.optimizer not in ("decentralized", "a2cid2"):
        return None
    if o.algorithm == "sgd":
        local = "SGD with momentum"
    else:
        local = "AccumAdam" if (o.accum_steps or 1) > 1 else "Adam (AccumAdam with s = 1)"
    return (
        f"one process: --optimizer {o.optimizer} has no other rank to average with, so this run is plain "
        f"{local} (consensus distance 0). To train on N processes, launch it with "
        f"`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N -m {module} ...` "
        f"(CPU, gloo; without ACCELERATE_USE_CPU on GPUs) or `torchrun --nproc-per-node N -m {module} ...`"
    )


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
    """Whether rank 0 has trained ``max_minutes`` (0: no limit), by its clock: the one the run's
    curve and reports record (a time budget taken from another run's report is that run's rank 0's).
    A collective, so every rank stops at the same step; call it at the same steps on every rank."""
    if max_minutes <= 0:
        return False
    flag = torch.tensor([float(seconds >= 60 * max_minutes)], device=accelerator.device)
    return bool(accelerator.gather(flag)[0] > 0)  # gathered in rank order


@contextlib.contextmanager
def consensus(model: nn.Module, optimizer: Any, decentralized: bool) -> Iterator[None]:
    """Evaluation mode without gradients, on the consensus model when ``decentralized`` (the exact
    average over ranks: a collective; each rank's own weights come back on exit)."""
    from decentadam.consensus import averaged

    context = averaged(model, optimizer) if decentralized else contextlib.nullcontext(model)
    with context, torch.no_grad():
        model.eval()
        try:
            yield
        finally:
            model.train()


class Parallel(Protocol):
    """A data-parallel method other than DDP + AdamW and DecentralizedAdam that a recipe's loop runs
    (``main(parallel=...)``; ``benchmarks.time_to_quality.alternatives``: DDP communication hooks,
    post-local SGD, decent-dp). The loop still calls ``optimizer.step()``, ``zero_grad()`` and the
    scheduler, and ``accelerator.no_sync(model)`` between micro-batches."""

    def prepare(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model and optimizer the loop trains with, in place of ``accelerator.prepare``'s."""
        ...

    def averaged(self, model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """Inside the block: the ranks' mean model, the module to save (a collective); each rank's
        own weights come back on exit."""
        ...


def log_step(
    accelerator: Accelerator,
    progress: Progress,
    step: int,
    values: dict[str, Any],
    postfix: dict[str, str],
    optimizer: Any | None,
    since: CommStats | None,
) -> CommStats | None:
    """Log a step's ``values`` (the trackers, and a JSON log line) and ``postfix`` (the bar or a text
    line: :class:`recipes.common.progress.Progress`), with the peak GPU
    memory and, for a decentralized ``optimizer`` (None: All-Reduce), the consensus distance and the
    communication wait since ``since``: a collective. Returns the counters to pass as ``since`` next."""
    from decentadam.consensus import metrics, unwrap_optimizer

    if torch.cuda.is_available():
        values["train/peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if optimizer is not None:
        health = metrics(optimizer, since=since)  # all-reduces a copy of the weights
        since = unwrap_optimizer(optimizer).stats.snapshot()
        values["decentadam/consensus_distance_rel"] = health["decentadam/consensus_distance_rel"]
        values["decentadam/comm_wait_ms"] = health["decentadam/comm_wait_ms"]
        postfix["consensus"] = f"{health['decentadam/consensus_distance_rel']:.1e}"
    accelerator.log(values, step=step)
    progress.log(step, values, postfix)
    return since


def finish(
    accelerator: Accelerator, progress: Progress, optimizer: Any | None, step: int, seconds: float, run: Path
) -> None:
    """End the run: close a decentralized ``optimizer`` (its last exchange finishes, its groups are
    released), end the trackers and print the last line."""
    from decentadam.consensus import unwrap_optimizer

    progress.close()
    if optimizer is not None:
        unwrap_optimizer(optimizer).close()
    accelerator.end_training()
    peak = (
        f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        if torch.cuda.is_available()
        else ""
    )
    accelerator.print(f"done: step {step}, {seconds:.0f} s of training{peak}; checkpoints in {run}")
