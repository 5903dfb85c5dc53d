"""The on-disk layout of a decentadam checkpoint: the one module that reads and writes it.

::

    path/
      model.safetensors            consensus weights (or what save_pretrained writes; Trainer's files)
      decentadam/meta.json         format version, world size, topology, optimizer step, user extra;
                                   written last, once every rank's file is in place
      decentadam/rank-00003.pt     rank 3's own state: weights, optimizer, scheduler, scaler, RNG
                                   (an All-Reduce run: no weights, the optimizer in rank 0's only;
                                   A2CiD2: the optimizer entry also holds x~ - x)

:func:`decentadam.checkpoint.save_checkpoint` writes such a directory atomically (staging it in a
hidden sibling, see :func:`replace_directory`); the Hugging Face Trainer integration writes the
``decentadam/`` part inside Trainer's own ``checkpoint-N`` directories. Both read it back through
:func:`read_meta` and :func:`check_resumable`. Nothing here is a collective.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import decentadam
from decentadam.a2cid2 import A2CiD2
from decentadam.decentralized import DecentralizedAdam

__all__ = [
    "ALLREDUCE",
    "FORMAT_VERSION",
    "WEIGHTS_NAME",
    "RunShape",
    "atomic_torch_save",
    "atomic_write_text",
    "check_resumable",
    "is_checkpoint",
    "is_foreign",
    "load_rank_state",
    "meta_file",
    "missing_rank_files",
    "rank_file",
    "read_meta",
    "recover",
    "replace_directory",
    "save_rank_state",
    "sibling",
    "state_dir",
    "write_meta",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
_STATE_DIR = "decentadam"
_META_NAME = "meta.json"


def state_dir(path: Path) -> Path:
    """``path/decentadam``: where the per-rank files and the metadata live."""
    return path / _STATE_DIR


def meta_file(path: Path) -> Path:
    return state_dir(path) / _META_NAME


def rank_file(path: Path, rank: int) -> Path:
    return state_dir(path) / f"rank-{rank:05d}.pt"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a complete checkpoint's metadata (the completion marker)."""
    return meta_file(path).is_file()


ALLREDUCE = "allreduce"
"""The ``topology`` recorded for a run whose optimizer is not decentralized (DDP's All-Reduce)."""


@dataclass(frozen=True)
class RunShape:
    """What must match for every rank to take its own state back: ranks, topology, node size."""

    world_size: int
    topology: str  # a topology name, ALLREDUCE, or "a2cid2-<graph>" for asynchronous gossip
    local_world_size: int | None  # None for ALLREDUCE and A2CiD2

    @classmethod
    def of(cls, optimizer: DecentralizedAdam | A2CiD2 | None, world_size: int) -> RunShape:
        """The shape of a decentralized run, or of an All-Reduce run of ``world_size`` ranks."""
        if optimizer is None:
            return cls(world_size, ALLREDUCE, None)
        if isinstance(optimizer, A2CiD2):
            return cls(optimizer.world_size, optimizer.run_name, None)
        return cls(optimizer.world_size, optimizer.topology.name, optimizer.topology.local_world_size)


def write_meta(path: Path, shape: RunShape, step: int | None, extra: dict[str, Any] | None = None) -> None:
    """Write the metadata (atomically): the last file of a checkpoint, which marks it complete."""
    meta = {
        "format": FORMAT_VERSION,
        "decentadam": decentadam.__version__,
        "world_size": shape.world_size,
        "topology": shape.topology,
        "local_world_size": shape.local_world_size,
        "step": step,
        "extra": extra or {},
    }
    atomic_write_text(meta_file(path), json.dumps(meta, indent=2) + "\n")


def read_meta(path: Path) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path``; raises if it is missing or of another format."""
    file = meta_file(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete decentadam checkpoint ({file} is missing). Pass the directory "
            "that save_checkpoint wrote."
        )
    meta: dict[str, Any] = json.loads(file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format {meta.get('format')} is not supported (expected {FORMAT_VERSION})"
        )
    return meta


def check_resumable(
    meta: dict[str, Any], shape: RunShape, path: Path, *, fix: str, allow_topology_change: bool
) -> bool:
    """Whether every rank can take its own state back (same world size, topology and node size).

    False when the world size differs (every rank restarts from the consensus weights), or when only
    the topology differs and ``allow_topology_change`` is set; raises ValueError, with ``fix`` as
    the advice, when only the topology differs: the resumed run would not continue the saved one.
    """
    if meta["world_size"] != shape.world_size:
        return False
    saved = (meta["topology"], meta.get("local_world_size", shape.local_world_size))
    if saved == (shape.topology, shape.local_world_size):
        return True
    if allow_topology_change:
        return False
    raise ValueError(
        f"checkpoint {path} was saved with topology {saved[0]!r} and local_world_size {saved[1]}, but this "
        f"run uses topology {shape.topology!r} and local_world_size {shape.local_world_size}: the resumed "
        f"run would not continue the saved one. {fix}"
    )


def missing_rank_files(path: Path, world_size: int) -> list[int]:
    """The ranks whose state file is not in ``path``."""
    return [rank for rank in range(world_size) if not rank_file(path, rank).is_file()]


def save_rank_state(path: Path, rank: int, state: dict[str, Any]) -> None:
    atomic_torch_save(state, rank_file(path, rank))


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    file = rank_file(path, rank)
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint is incomplete")
    # Our own file; it holds Python and NumPy RNG states, which weights_only loading rejects.
    state: dict[str, Any] = torch.load(file, map_location="cpu", weights_only=False)
    return state


# ---------------------------------------------------------------------------- atomic writes


def atomic_torch_save(obj: object, target: Path) -> None:
    temporary = target.with_name(target.name + ".tmp")
    with open(temporary, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, target)


def atomic_write_text(target: Path, text: str) -> None:
    temporary = target.with_name(target.name + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, target)


def sibling(final: Path, tag: str) -> Path:
    """``.NAME.TAG`` beside ``final``: the staging (``incomplete``) and ``previous`` directories."""
    return final.parent / f".{final.name}.{tag}"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(staging: Path, final: Path) -> None:
    """Move the complete ``staging`` to ``final``; the old ``final`` survives until then."""
    for file in staging.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [*(d for d in staging.rglob("*") if d.is_dir()), staging]:
        _fsync_directory(directory)  # the renames of the files into them (a power loss keeps them)
    previous = sibling(final, "previous")
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.rename(final, previous)  # killed here: recover() puts it back
    os.rename(staging, final)
    _fsync_directory(final.parent)
    shutil.rmtree(previous, ignore_errors=True)


def recover(final: Path) -> None:
    """Undo a save killed between its two renames: bring the previous checkpoint back.

    Every rank of a load runs this at once: one rank's rename wins, the others find ``final`` there.
    """
    previous = sibling(final, "previous")
    if not final.exists() and is_checkpoint(previous):
        try:
            os.rename(previous, final)
        except OSError:
            if is_checkpoint(final):
                return  # another rank restored it first
            raise
        logger.warning("restored %s from %s (a save was interrupted)", final, previous)


def is_foreign(final: Path) -> bool:
    """Whether ``final`` holds something other than a checkpoint (an empty directory is fine)."""
    if not final.exists() and not final.is_symlink():
        return False
    if is_checkpoint(final):
        return False
    return not (final.is_dir() and not final.is_symlink() and not any(final.iterdir()))
