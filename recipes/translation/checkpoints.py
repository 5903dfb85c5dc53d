"""The run directory's checkpoints: ``run/step-0001000/``, one per save, the last K kept.

``train.py`` writes each with :func:`decentadam.checkpoint.save_checkpoint`, for both optimizers:
a Hugging Face model directory (``config.json``, ``model.safetensors``, ``generation_config.json``
and the tokenizer files, all in one atomic write), so ``AutoModelForSeq2SeqLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it, plus under ``decentadam/`` the state an exact resume
needs: every rank's own weights and AccumAdam state for a decentralized run (the model file is
their consensus average), rank 0's AdamW state for the All-Reduce baseline, and every rank's
scheduler and RNG states.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from accelerate import Accelerator

from decentadam import checkpoint_files

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(run: Path, step: int) -> Path:
    return run / f"step-{step:07d}"


def list_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints of ``run``, oldest first."""
    if not run.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in run.iterdir()
        if (match := STEP_DIR.match(path.name)) and checkpoint_files.is_checkpoint(path)
    ]
    return [path for _, path in sorted(found)]


def prune(run: Path, keep: int, accelerator: Accelerator) -> None:
    """Delete all but the last ``keep`` checkpoints of ``run`` (main process; only step-N directories)."""
    if accelerator.is_main_process and keep > 0:
        for old in list_checkpoints(run)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
