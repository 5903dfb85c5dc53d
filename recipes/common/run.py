"""A recipe's run directory: its checkpoints, its configuration and its metrics.

::

    OUTPUT_DIR/
      config.toml      the effective configuration, written at every start (and resume)
      metrics.jsonl    one JSON line per evaluation: step, train_seconds, the recipe's scores and
                       train_loss (the mean training loss of the logged steps since the previous one)
      tb/              TensorBoard events (train.report_to, recipes/common/trackers.py)
      wandb/           Weights & Biases' files, with train.report_to = wandb or all
      step-N/          the checkpoint after N optimizer steps

Each ``step-N`` is written by :func:`decentadam.checkpoint.save_checkpoint` (a Hugging Face model
directory that ``from_pretrained`` loads, plus ``decentadam/`` with every rank's state for an exact
resume) and is complete once :func:`decentadam.checkpoint_files.is_checkpoint` says so: its metadata
is written last. One rule for ``train.keep_last``: after each save, every complete checkpoint but the
newest ``keep_last`` is deleted (renamed to a hidden ``.step-N.deleting`` first, so that a run killed
while deleting never leaves a ``step-N`` that looks complete but is not); 0 keeps them all.
:func:`list_checkpoints` is also how ``python -m eval.bleu --average-last`` finds a run's checkpoints.

:meth:`RunDirectory.resume_from` decides how a run starts, from ``--resume``: ``none`` (a new run),
``must`` (continue from the newest checkpoint) or ``auto`` (continue if there is one, else start a
new run: what a launcher's automatic restart needs, see docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decentadam import checkpoint_files
from recipes.common.config import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["RESUME_MODES", "SAVE_DELAY_ENV", "RunDirectory", "list_checkpoints", "step_name"]

RESUME_MODES = ("none", "must", "auto")
"""``--resume``: absent (a new run), bare or ``must`` (continue from the newest checkpoint), ``auto``
(continue if the run directory holds a checkpoint, else start a new run)."""

_OWN_FILES = frozenset(("config.toml", "metrics.jsonl", "metrics.jsonl.tmp", "tb", "wandb"))
"""What a recipe writes into its run directory besides the numbered checkpoints."""
_OWN_HIDDEN = re.compile(r"^\.[A-Za-z_]+-\d+\.(incomplete|previous|deleting)$")
"""A save's staging and swap directories (checkpoint_files.sibling), and a deletion in progress."""

_NUMBERED = re.compile(r"^[A-Za-z_]+-(\d+)$")
"""``step-N`` (the recipes), ``checkpoint-N`` (the Trainer integration): a name, a dash, the step."""


def step_name(step: int) -> str:
    """The directory name of the checkpoint after ``step`` optimizer steps: ``step-N``."""
    return f"step-{step}"


def list_checkpoints(run: Path) -> list[Path]:
    """The complete decentadam checkpoints ``NAME-N`` directly in ``run``, in the order of N."""
    if not run.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in run.iterdir()
        if (match := _NUMBERED.match(path.name)) and checkpoint_files.is_checkpoint(path)
    ]
    return [path for _, path in sorted(found)]


SAVE_DELAY_ENV = "RECIPES_CHAOS_SAVE_DELAY_S"


class _SlowSave:
    """A processor whose ``save_pretrained`` sleeps first (:meth:`RunDirectory.saving`)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def save_pretrained(self, directory: str) -> Any:
        time.sleep(self.delay)
        return self.inner.save_pretrained(directory)


class RunDirectory:
    """``train.output_dir`` of one run, seen from every rank; writes happen on the main process."""

    def __init__(self, path: Path, accelerator: Accelerator) -> None:
        self.path, self.accelerator = path, accelerator

    def resume_from(self, resume: str) -> Path | None:
        """The checkpoint to continue from (the newest complete one), or None for a new run.

        ``resume`` is one of :data:`RESUME_MODES`. A new run (``none``) refuses a directory that
        holds checkpoints (it would mix two runs), and ``must`` one that holds none. ``auto``
        continues from the newest complete checkpoint, or starts a new run when there is none, but
        refuses a directory that holds files this recipe does not write (not a run directory: a new
        run there would mix with them). Checkpoints a killed save left incomplete are skipped; a
        save killed between its two renames is undone first. Every rank calls it.
        """
        if resume not in RESUME_MODES:
            raise ConfigError(f"--resume {resume!r}: expected one of {', '.join(RESUME_MODES)}")
        if resume == "auto":
            self._check_ours()
        for hidden in self.path.glob(".*.previous") if self.path.is_dir() else ():
            checkpoint_files.recover(self.path / hidden.name[1 : -len(".previous")])
        previous = list_checkpoints(self.path)
        if previous and resume == "none":
            raise ConfigError(
                f"{self.path} already holds checkpoints ({previous[-1].name}): pass --resume (or "
                "--resume auto) to continue that run, or another output_dir for a new one"
            )
        if resume == "must" and not previous:
            raise ConfigError(
                f"--resume: {self.path} holds no complete checkpoint to resume from; pass --resume auto "
                "to start a new run when there is none"
            )
        return previous[-1] if previous else None

    def _check_ours(self) -> None:
        """Raise ConfigError unless ``path`` is absent, empty, or holds only what a run writes."""
        if not self.path.exists():
            return
        if not self.path.is_dir():
            raise ConfigError(
                f"--resume auto: output_dir {self.path} is a file, not a run directory; pass another "
                "output_dir"
            )
        foreign = sorted(
            entry.name
            for entry in self.path.iterdir()
            if entry.name not in _OWN_FILES
            and not _OWN_HIDDEN.match(entry.name)
            and not (_NUMBERED.match(entry.name) and entry.is_dir())
        )
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConfigError(
                f"--resume auto: output_dir {self.path} is not a run directory of this recipe: it holds "
                f"{shown}, which a run does not write (a run writes config.toml, metrics.jsonl, tb/ and "
                "step-N/ checkpoints). Pass an output_dir that is new, empty or an earlier run's"
            )

    def keep_metrics_until(self, step: int) -> None:
        """Drop the ``metrics.jsonl`` lines after ``step``: a restarted run redoes those steps and
        records them again (main process)."""
        file = self.path / "metrics.jsonl"
        if not self.accelerator.is_main_process or not file.is_file():
            return
        lines = file.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and int(json.loads(line)["step"]) <= step]
        if len(kept) != len(lines):
            checkpoint_files.atomic_write_text(file, "".join(kept))

    def saving(self, processor: Any) -> Any:
        """``processor`` as ``save_checkpoint(processor=...)`` takes it. For ``benchmarks.chaos`` only:
        with ``RECIPES_CHAOS_SAVE_DELAY_S`` set, its ``save_pretrained`` (rank 0, half-way through the
        save: the weights are staged, no rank file is) first sleeps that many seconds, so that a fault
        can land while a checkpoint is half written."""
        delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
        return _SlowSave(processor, delay) if delay > 0 else processor

    def write_config(self, text: str) -> None:
        if self.accelerator.is_main_process:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "config.toml").write_text(text)

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint after ``step`` optimizer steps goes."""
        return self.path / step_name(step)

    def save(
        self,
        step: int,
        model: Any,
        optimizer: Any,
        *,
        scheduler: Any,
        extra: dict[str, Any],
        processor: Any,
        keep_last: int,
    ) -> None:
        """Write the checkpoint after ``step`` (:func:`decentadam.checkpoint.save_checkpoint`: the
        consensus model of a decentralized run, every rank's state, ``processor``; atomic), then keep
        the newest ``keep_last`` (:meth:`prune`). Every rank calls it."""
        from decentadam.checkpoint import save_checkpoint

        save_checkpoint(
            self.checkpoint(step), model, optimizer, scheduler=scheduler, extra=extra, processor=processor
        )
        self.prune(keep_last)

    def prune(self, keep_last: int) -> None:
        """Delete all but the newest ``keep_last`` checkpoints (0: keep all); every rank calls it."""
        if self.accelerator.is_main_process and keep_last > 0:
            for doomed in self.path.glob(".*.deleting"):  # left by a run killed while deleting
                shutil.rmtree(doomed)
            for old in list_checkpoints(self.path)[:-keep_last]:
                doomed = checkpoint_files.sibling(old, "deleting")
                os.rename(old, doomed)  # atomic: killed after it, no half-deleted step-N remains
                shutil.rmtree(doomed)
        self.accelerator.wait_for_everyone()

    def record(self, values: dict[str, Any]) -> None:
        """Append one line to ``metrics.jsonl`` (main process)."""
        if self.accelerator.is_main_process:
            with open(self.path / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(values) + "\n")
