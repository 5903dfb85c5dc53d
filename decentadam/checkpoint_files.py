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
``decentadam/`` part inside Trainer's own ``checkpoint-N`` directories, and the fairseq2 adapter
inside fairseq2's ``step_N`` ones (there a ``decentadam/`` without ``meta.json`` is a save that
did not finish: :func:`is_unfinished`). All read it back through :func:`read_meta`,
:func:`check_resumable` and :func:`load_rank_state`. Nothing here is a collective.

Rank files are safe to load from anyone: they hold only tensors and plain values (dicts, lists,
tuples, numbers, strings, None; :func:`check_plain` refuses anything else before writing), and
:func:`load_rank_state` reads them with ``torch.load(weights_only=True)``, which builds no other
object and so runs no code from the file. A file that holds other objects is refused with
:class:`RefusedRankFile`. Rank files written by decentadam 0.1.0 before this rule kept NumPy's RNG
state as a NumPy array; ``python -m decentadam.checkpoint_files upgrade DIR`` converts them once
(:func:`upgrade_rank_files`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.torch_version import TorchVersion

import decentadam
from decentadam.asynchronous.a2cid2 import A2CiD2
from decentadam.decentralized import DecentralizedAdam

__all__ = [
    "ALLREDUCE",
    "FORMAT_VERSION",
    "WEIGHTS_NAME",
    "RefusedRankFile",
    "RunShape",
    "atomic_torch_save",
    "atomic_write_text",
    "check_plain",
    "check_resumable",
    "is_checkpoint",
    "is_foreign",
    "is_unfinished",
    "load_rank_state",
    "mark_unfinished",
    "meta_file",
    "missing_rank_files",
    "numpy_rng_state",
    "plain_numpy_rng_state",
    "rank_file",
    "read_meta",
    "recover",
    "replace_directory",
    "save_rank_state",
    "sibling",
    "state_dir",
    "unmark_unfinished",
    "upgrade_rank_files",
    "write_meta",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
_STATE_DIR = "decentadam"
_META_NAME = "meta.json"
_UNFINISHED_NAME = "saving"


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


def mark_unfinished(path: Path) -> None:
    """Claim ``path`` for a decentadam save in progress, before anything else of it is written.

    For layouts where another program commits ``path`` before decentadam writes its part (the
    fairseq2 adapter): from then on ``path`` counts as :func:`is_unfinished` until ``meta.json``.
    """
    state_dir(path).mkdir(parents=True, exist_ok=True)
    atomic_write_text(state_dir(path) / _UNFINISHED_NAME, "a decentadam save is in progress\n")


def unmark_unfinished(path: Path) -> None:
    """Drop the claim of :func:`mark_unfinished`, once ``meta.json`` is written (tidiness only)."""
    (state_dir(path) / _UNFINISHED_NAME).unlink(missing_ok=True)


def is_unfinished(path: Path) -> bool:
    """Whether ``path`` holds a decentadam state directory whose save never wrote ``meta.json``."""
    return state_dir(path).is_dir() and not is_checkpoint(path)


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
    """Write rank ``rank``'s state file; raises TypeError if ``state`` is not plain (:func:`check_plain`)."""
    check_plain(state, f"rank {rank}'s checkpoint state")
    atomic_torch_save(state, rank_file(path, rank))


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state, loaded without running code from the file (module docstring).

    Raises FileNotFoundError if the file is missing, :class:`RefusedRankFile` if it holds anything
    but tensors and plain values, and RuntimeError with a torch older than 2.6.
    """
    file = rank_file(path, rank)
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint is incomplete")
    _check_safe_torch_load(file)
    try:
        state: dict[str, Any] = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise RefusedRankFile(_refusal(file, path)) from error
    return state


class RefusedRankFile(pickle.UnpicklingError):
    """A rank file holds objects that only running code could rebuild; it was not loaded."""


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # these classes exactly: not their subclasses


def check_plain(value: object, where: str) -> None:
    """Raise TypeError, naming the entry, unless ``value`` is tensors and plain values only.

    Plain: dict, OrderedDict, list and tuple of plain values; None, bool, int, float, complex, str,
    bytes, ``torch.Size``, ``torch.dtype``, ``torch.device``; tensors (not tensor subclasses). These
    are what ``torch.load(weights_only=True)`` rebuilds without running code.
    """
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        kind = type(item)
        if kind in _PLAIN_LEAVES or kind in _PLAIN_TENSORS:
            continue
        if kind is dict or kind is OrderedDict:
            assert isinstance(item, dict)
            stack += [(key, f"{path} (a key)") for key in item]
            stack += [(entry, f"{path}[{key!r}]") for key, entry in item.items()]
            attributes = getattr(item, "__dict__", {})  # a state_dict's _metadata
            stack += [(entry, f"{path}.{name}") for name, entry in attributes.items()]
        elif kind is list or kind is tuple:
            assert isinstance(item, list | tuple)
            stack += [(entry, f"{path}[{i}]") for i, entry in enumerate(item)]
        else:
            raise TypeError(
                f"{path} is a {kind.__module__}.{kind.__qualname__}; a checkpoint's rank file holds only "
                "tensors and plain values (dict, list, tuple, numbers, str, None), so that loading it runs "
                "no code. Convert it to those (e.g. a NumPy array to a tensor) in its state_dict()."
            )


def _check_safe_torch_load(file: Path) -> None:
    if TorchVersion(torch.__version__) < "2.6":
        raise RuntimeError(
            f"{file}: loading a checkpoint safely needs torch 2.6 or newer (torch {torch.__version__}'s "
            "torch.load(weights_only=True) can run code from a crafted file: CVE-2025-32434). Upgrade "
            "torch: pip install 'torch>=2.6'."
        )


# What an old rank file's NumPy RNG state needs, by the names NumPy 1 and 2 pickle them under.
_OLD_NUMPY_GLOBALS = frozenset(
    (
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.dtypes.UInt32DType",
    )
)


def _unsafe_globals(file: Path) -> list[str] | None:
    """The classes and functions the file's pickle names beyond the safe ones (None: unreadable)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # not a torch.save zip file (a bare pickle, say): refused all the same
        return None


def _refusal(file: Path, path: Path) -> str:
    found = _unsafe_globals(file)
    if found and set(found) <= _OLD_NUMPY_GLOBALS:
        return (
            f"{file} was written by an earlier decentadam, which kept NumPy's RNG state as a NumPy array; "
            "rank files are now loaded with torch.load(weights_only=True), which refuses NumPy arrays. If "
            "this checkpoint is your own (or you trust its origin), convert its rank files once with "
            f"`python -m decentadam.checkpoint_files upgrade {path}`, then load it again."
        )
    named = f" ({', '.join(sorted(found))})" if found else ""
    return (
        f"refused to load {file}: it holds Python objects that loading would have to run code to "
        f"build{named}. decentadam writes only tensors and plain values, so this file was not written "
        "by decentadam or was altered after; it may be crafted to run commands on this machine. It was "
        "not loaded. Resume from a checkpoint that your own run wrote (or delete this one and resume "
        "from an earlier one); do not load this file with weights_only=False."
    )


# ---------------------------------------------------------------------------- NumPy's RNG state


def plain_numpy_rng_state(state: Any) -> tuple[Any, ...]:
    """``numpy.random.get_state()`` with its key array as a tensor: a plain value for a rank file."""
    name, keys, position, has_gauss, cached_gaussian = state
    keys_tensor = torch.tensor([int(k) for k in keys], dtype=torch.int64)  # (624,) uint32 values
    return (str(name), keys_tensor, int(position), int(has_gauss), float(cached_gaussian))


def numpy_rng_state(plain: tuple[Any, ...]) -> tuple[Any, ...]:
    """The inverse of :func:`plain_numpy_rng_state`: what ``numpy.random.set_state`` takes."""
    import numpy

    name, keys, position, has_gauss, cached_gaussian = plain
    return (name, keys.numpy().astype(numpy.uint32), position, has_gauss, cached_gaussian)


def upgrade_rank_files(path: Path) -> list[Path]:
    """Rewrite the rank files of checkpoint ``path`` that an earlier decentadam wrote; returns them.

    Those files keep NumPy's RNG state as a NumPy array, which :func:`load_rank_state` refuses.
    They are read with ``torch.load(weights_only=True)`` allowing NumPy's array reconstruction and
    nothing else (a file that needs more is refused, as by :func:`load_rank_state`), and written
    back (atomically) with the state in plain form. Files already plain are left as they are.
    """
    import numpy

    reconstruct = numpy.ndarray.__reduce__(numpy.zeros(1))[0]  # numpy's _reconstruct, wherever it lives
    allowed: list[Any] = [numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]
    allowed += [(reconstruct, name) for name in _OLD_NUMPY_GLOBALS if name.endswith("_reconstruct")]
    upgraded = []
    for file in sorted(state_dir(path).glob("rank-*.pt")):
        _check_safe_torch_load(file)
        try:
            torch.load(file, map_location="cpu", weights_only=True)
            continue  # plain already
        except pickle.UnpicklingError:
            pass
        with torch.serialization.safe_globals(allowed):
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as error:
                raise RefusedRankFile(_refusal(file, path)) from error
        rng = state.get("rng") or {}
        if "numpy" in rng:
            rng["numpy"] = plain_numpy_rng_state(rng["numpy"])
        check_plain(state, str(file))
        atomic_torch_save(state, file)
        upgraded.append(file)
    return upgraded


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


# ---------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m decentadam.checkpoint_files",
        description="Maintain decentadam checkpoint directories.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    upgrade = commands.add_parser(
        "upgrade",
        help="convert the rank files of checkpoints written by an earlier decentadam (NumPy RNG state) "
        "to the plain form that loading accepts",
    )
    upgrade.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint directories")
    args = parser.parse_args(argv)
    for path in args.checkpoints:
        if not state_dir(path).is_dir():
            parser.error(f"{path} has no {_STATE_DIR}/ directory: not a decentadam checkpoint")
        done = upgrade_rank_files(path)
        print(f"{path}: {len(done)} rank file(s) converted" if done else f"{path}: nothing to convert")
    return 0


if __name__ == "__main__":
    sys.exit(main())
