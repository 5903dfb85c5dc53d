"""A recipe's run directory: its checkpoints, its configuration and its metrics.

::

    OUTPUT_DIR/
      config.toml      the effective configuration, written at every start (and resume)
      metrics.jsonl    one JSON line per evaluation: step, train_seconds and the recipe's scores
      tb/              TensorBoard events
      step-N/          the checkpoint after N optimizer steps

Each ``step-N`` is written by :func:`decentadam.checkpoint.save_checkpoint` (a Hugging Face model
directory that ``from_pretrained`` loads, plus ``decentadam/`` with every rank's state for an exact
resume) and is complete once :func:`decentadam.checkpoint_files.is_checkpoint` says so: its metadata
is written last. One rule for ``train.keep_last``: after each save, every complete checkpoint but the
newest ``keep_last`` is deleted; 0 keeps them all. :func:`list_checkpoints` is also how
``python -m eval.bleu --average-last`` finds a run's checkpoints.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decentadam import checkpoint_files
from recipes.common.config import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["RunDirectory", "list_checkpoints", "step_name"]

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


class RunDirectory:
    """``train.output_dir`` of one run, seen from every rank; writes happen on the main process."""

    def __init__(self, path: Path, accelerator: Accelerator) -> None:
        self.path, self.accelerator = path, accelerator

    def resume_from(self, resume: bool) -> Path | None:
        """The checkpoint to continue from (``--resume``: the newest), or None for a new run.

        A new run refuses a directory that holds checkpoints (it would mix two runs), and
        ``--resume`` one that holds none.
        """
        previous = list_checkpoints(self.path)
        if previous and not resume:
            raise ConfigError(
                f"{self.path} already holds checkpoints ({previous[-1].name}): pass --resume or another "
                "output_dir"
            )
        if resume and not previous:
            raise ConfigError(f"--resume: {self.path} holds no checkpoint to resume from")
        return previous[-1] if previous else None

    def write_config(self, text: str) -> None:
        if self.accelerator.is_main_process:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "config.toml").write_text(text)

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint after ``step`` optimizer steps goes."""
        return self.path / step_name(step)

    def prune(self, keep_last: int) -> None:
        """Delete all but the newest ``keep_last`` checkpoints (0: keep all); every rank calls it."""
        if self.accelerator.is_main_process and keep_last > 0:
            for old in list_checkpoints(self.path)[:-keep_last]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()

    def record(self, values: dict[str, Any]) -> None:
        """Append one line to ``metrics.jsonl`` (main process)."""
        if self.accelerator.is_main_process:
            with open(self.path / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(values) + "\n")
