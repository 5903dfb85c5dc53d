"""The run directory's checkpoints: ``run/step-0001000/``, one per save, the last K kept.

Each checkpoint is a Hugging Face model directory (``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files), so ``AutoModelForSeq2SeqLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it, plus the state an exact resume needs:

- ``--optimizer decentralized``: written by :func:`decentadam.checkpoint.save_checkpoint` (the
  consensus model, and every rank's own weights, AccumAdam state, scheduler and RNG state under
  ``decentadam/``); the tokenizer is added once it is complete.
- ``--optimizer allreduce``: every rank holds the same weights, so rank 0 writes the model, the
  AdamW, scheduler and loss-scaler states to ``allreduce/state.pt``, every rank its RNG state to
  ``allreduce/rng-RANK.pt``, and ``allreduce/meta.json`` last. Like decentadam's checkpoints it is
  staged in a hidden sibling directory and renamed into place once complete. A resumed run matches
  an uninterrupted one up to float rounding only: DDP regroups its gradient buckets after the first
  iteration of each process, which changes the order of the sums (differences of ~1e-5 in a few
  weights after two steps in the test); decentadam's resume is bit for bit.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from decentadam.checkpoint import load_checkpoint, save_checkpoint

STEP_DIR = re.compile(r"^step-(\d+)$")
ALLREDUCE_DIR = "allreduce"
COMPLETE_MARKERS = ("decentadam/meta.json", f"{ALLREDUCE_DIR}/meta.json")


def step_dir(run: Path, step: int) -> Path:
    return run / f"step-{step:07d}"


def list_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints of ``run``, oldest first."""
    if not run.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in run.iterdir()
        if (match := STEP_DIR.match(path.name)) and any((path / m).is_file() for m in COMPLETE_MARKERS)
    ]
    return [path for _, path in sorted(found)]


def save(
    path: Path,
    accelerator: Accelerator,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    tokenizer: Any,
    extra: dict[str, Any],
    decentralized: bool,
) -> None:
    """Write a checkpoint at ``path`` (every rank calls this)."""
    if decentralized:
        save_checkpoint(path, model, optimizer, scheduler=scheduler, extra=extra)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(path)
        accelerator.wait_for_everyone()
        return
    staging = path.parent / f".{path.name}.incomplete"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / ALLREDUCE_DIR).mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(_rng_state(), staging / ALLREDUCE_DIR / f"rng-{accelerator.process_index:05d}.pt")
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        scaler = accelerator.scaler
        state = {
            "model": unwrapped.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        torch.save(state, staging / ALLREDUCE_DIR / "state.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {"world_size": accelerator.num_processes, "extra": extra}
        (staging / ALLREDUCE_DIR / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    accelerator.wait_for_everyone()


def load(
    path: Path, accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, decentralized: bool
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save` into the prepared objects; return its ``extra``."""
    if decentralized:
        return load_checkpoint(path, model, optimizer, scheduler=scheduler)
    meta = json.loads((path / ALLREDUCE_DIR / "meta.json").read_text())
    if meta["world_size"] != accelerator.num_processes:
        raise ValueError(
            f"{path} was saved by {meta['world_size']} processes; resume it with as many (got "
            f"{accelerator.num_processes}) for the same data order"
        )
    state = torch.load(path / ALLREDUCE_DIR / "state.pt", map_location="cpu", weights_only=False)
    accelerator.unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"] is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    rng = torch.load(
        path / ALLREDUCE_DIR / f"rng-{accelerator.process_index:05d}.pt",
        map_location="cpu",
        weights_only=False,
    )
    _restore_rng(rng)
    return dict(meta["extra"])


def prune(run: Path, keep: int, accelerator: Accelerator) -> None:
    """Delete all but the last ``keep`` checkpoints of ``run`` (main process; only step-N directories)."""
    if accelerator.is_main_process and keep > 0:
        for old in list_checkpoints(run)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
