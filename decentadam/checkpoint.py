"""Checkpoints of decentralized training: the consensus model for users, per-rank state for resuming.

A checkpoint is a directory laid out as :mod:`decentadam.checkpoint_files` describes: the consensus
average of every rank's weights (parameters and float buffers; Hugging Face models are written with
``save_pretrained``, so ``AutoModel.from_pretrained(path)`` loads it), and each rank's own weights,
optimizer state (Adam moments, step counter), scheduler, loss-scaler and RNG states: everything an
exact resume needs. The optimizer of an All-Reduce baseline (AdamW under DDP) is checkpointed
by the same functions: its ranks hold the same weights and moments, so rank 0's are saved once.

Every rank calls :func:`save_checkpoint` and :func:`load_checkpoint` at the same point (they are
collectives); ``path`` must be on a filesystem that every rank sees. Writes are atomic: everything
goes to a hidden sibling directory, which replaces ``path`` by rename only once complete, so a run
killed while saving leaves the previous checkpoint intact (the next save or load tidies up).

Resuming with the same world size restores each rank exactly: the continued run computes
bitwise the same losses as an uninterrupted one (given the same data order, which the caller
restores from ``extra``, e.g. the epoch and batch index). With another world size every rank starts
from the consensus weights with fresh optimizer moments, and a warning says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from decentadam import checkpoint_files as files
from decentadam.asynchronous.a2cid2 import A2CiD2
from decentadam.consensus import Decentralized, averaged
from decentadam.decentralized import DecentralizedAdam

__all__ = ["load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any,
    *,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    extra: dict[str, Any] | None = None,
    processor: Any | None = None,
) -> Path:
    """Write a checkpoint of ``model`` at ``path`` atomically (call on every rank).

    Args:
        path: the checkpoint directory: a new path, an empty directory, or an earlier checkpoint,
            which is replaced only once the new one is complete. Any other existing path raises
            FileExistsError on every rank (nothing is deleted).
        model: this rank's model (unwrapped from DDP / torch.compile wrappers if needed).
        optimizer: the :class:`DecentralizedAdam` or :class:`~decentadam.A2CiD2` training ``model``,
            or the optimizer of an All-Reduce (DDP) baseline, whose ranks hold the same weights and
            moments: then rank 0's model and optimizer state are saved once, and every rank's RNG
            state (Accelerate's wrappers are looked through). A2CiD2's averagings pause while saving.
        scheduler: an LR scheduler whose ``state_dict`` is saved with each rank's state.
        scaler: an fp16 loss scaler (``torch.amp.GradScaler``) whose scale and growth tracker are
            saved; default: the scaler of Accelerate's optimizer wrapper, if any.
        extra: JSON-serialisable values to resume the loop (epoch, batch index, ...), from rank 0.
        processor: a tokenizer or image processor that rank 0 saves with ``save_pretrained`` next to
            the model, inside the same atomic write.

    Returns the checkpoint directory.
    """
    final = Path(path)
    run = _Training.of(optimizer)
    module = _unwrap_model(model)
    scaler = scaler if scaler is not None else _accelerate_scaler(optimizer)
    try:
        extra_json = json.dumps(extra or {})
    except TypeError as not_json:
        raise TypeError(f"save_checkpoint: extra must be JSON-serialisable ({not_json})") from None
    staging = files.sibling(final, "incomplete")

    # Every phase ends with _statuses (a collective, so also a barrier): whatever fails on one rank
    # makes every rank raise, instead of leaving the others blocked in the next collective.
    # Phase 1, rank 0 alone: make room. Every rank learns the outcome before any rank writes.
    refused = False
    error: Exception | None = None
    if run.rank == 0:
        try:
            files.recover(final)
            refused = files.is_foreign(final)
            if not refused:
                if staging.exists():
                    shutil.rmtree(staging)  # left by a run killed while saving
                files.state_dir(staging).mkdir(parents=True)
        except Exception as caught:
            error = caught
    status = run.statuses(_REFUSED if refused else _FAILED if error is not None else _OK)
    if status[0] == _REFUSED:
        raise FileExistsError(
            f"save_checkpoint: {final} exists and is not a decentadam checkpoint (it has no "
            f"{files.meta_file(final)}); saving would delete what it holds. Pick a new or empty directory."
        )
    _raise_if_failed(status, error, f"could not create the staging directory {staging}.")

    # Phase 2, every rank: rank 0 the consensus weights, each rank its own state file. A2CiD2's
    # averagings pause meanwhile, so that the average is exact and each rank's x and x~ are saved
    # together with no exchange half applied.
    error = None
    with run.paused():
        with averaged(module, run.decentralized) if run.decentralized else contextlib.nullcontext():
            if run.rank == 0:
                try:
                    _write_weights(module, staging)
                    if processor is not None:
                        processor.save_pretrained(str(staging))
                except Exception as caught:
                    error = caught
        state = {  # All-Reduce: the weights are the model file's, the moments rank 0's (the same everywhere)
            "model": module.state_dict() if run.decentralized else None,
            "optimizer": run.optimizer.state_dict() if run.decentralized or run.rank == 0 else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "rng": _capture_rng(),
        }
    if error is None:
        try:
            if not files.state_dir(staging).is_dir():
                raise RuntimeError(
                    f"save_checkpoint: rank {run.rank} does not see {files.state_dir(staging)}, which "
                    f"rank 0 created. {_SHARED_FILESYSTEM}"
                )
            files.save_rank_state(staging, run.rank, state)
        except Exception as caught:
            error = caught
    status = run.statuses(_FAILED if error is not None else _OK)
    if run.rank == 0 and any(status):
        shutil.rmtree(staging, ignore_errors=True)
    _raise_if_failed(status, error, f"could not write their state to {staging}. {_SHARED_FILESYSTEM}")

    # Phase 3, rank 0 alone: the metadata (the completion marker), then the rename into place.
    if run.rank == 0:
        try:
            missing = files.missing_rank_files(staging, run.world_size)
            if missing:
                raise RuntimeError(
                    f"save_checkpoint: the state files of ranks {missing} are not in {staging}. "
                    f"{_SHARED_FILESYSTEM}"
                )
            files.write_meta(staging, run.shape, run.step, json.loads(extra_json))
            files.replace_directory(staging, final)
        except Exception as caught:
            error = caught
            shutil.rmtree(staging, ignore_errors=True)
    status = run.statuses(_FAILED if error is not None else _OK)
    _raise_if_failed(status, error, f"could not complete the checkpoint {final}.")
    logger.info("saved checkpoint %s (step %s, %d ranks)", final, run.step, run.world_size)
    return final


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any | None = None,
    *,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    restore_rng: bool = True,
    allow_topology_change: bool = False,
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint`; return its ``extra`` dict.

    Call on every rank *after* building the optimizer (its construction broadcasts rank 0's weights,
    which this then replaces with each rank's own). With the world size and topology of the save,
    each rank gets back its own weights, optimizer, scheduler, loss-scaler and RNG states. With
    another world size, or without an optimizer, every rank loads the consensus weights; the
    optimizer keeps fresh moments (a warning says so) and the scheduler and scaler continue from
    rank 0's state. Another topology or ``local_world_size`` on the same world size raises
    ValueError, unless ``allow_topology_change=True``, which restarts from the consensus weights in
    the same way. A checkpoint of an All-Reduce run loads into an All-Reduce optimizer on any number
    of ranks (the saved weights and moments, rank 0's; the RNG streams only on the same number);
    switching between All-Reduce and decentralized counts as a topology change. ``scaler`` defaults
    to the scaler of Accelerate's optimizer wrapper, if any.
    """
    final = Path(path)
    files.recover(final)
    meta = files.read_meta(final)
    module = _unwrap_model(model)
    run = _Training.of(optimizer) if optimizer is not None else None
    if scaler is None and optimizer is not None:
        scaler = _accelerate_scaler(optimizer)

    exact = run is not None and files.check_resumable(
        meta,
        run.shape,
        final,
        allow_topology_change=allow_topology_change,
        fix=f"Build the optimizer with topology={meta['topology']!r}, "
        f"local_world_size={meta.get('local_world_size')}, or pass allow_topology_change=True to restart "
        "every rank from the consensus weights with fresh optimizer moments.",
    )
    if run is None:
        _read_weights(module, final)
        return dict(meta["extra"])
    if exact or (run.decentralized is None and meta["topology"] == files.ALLREDUCE):
        state = files.load_rank_state(final, run.rank if exact else 0)
        if run.decentralized is not None:  # each rank its own weights and moments
            with run.paused():
                module.load_state_dict(state["model"])
                run.optimizer.load_state_dict(state["optimizer"])
        else:  # one copy of the weights and moments (rank 0's), valid on any number of ranks
            _read_weights(module, final)
            moments = (
                state["optimizer"]
                if state["optimizer"] is not None
                else files.load_rank_state(final, 0)["optimizer"]
            )
            run.optimizer.load_state_dict(moments)
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        _load_scaler(scaler, state, final)
        if exact and restore_rng:
            _restore_rng(state["rng"])
        if not exact:
            _warn(
                f"checkpoint {final} was saved by {meta['world_size']} ranks and is loaded by "
                f"{run.world_size}: the random number streams are not restored."
            )
        return dict(meta["extra"])

    _read_weights(module, final)
    saved_by, loaded_by = f"{meta['world_size']} ranks", f"{run.world_size}"
    if meta["world_size"] == run.world_size:
        saved_by += f" with topology {meta['topology']!r} (local_world_size {meta.get('local_world_size')})"
        loaded_by += f" with {run.shape.topology!r} (local_world_size {run.shape.local_world_size})"
    _warn(
        f"checkpoint {final} was saved by {saved_by} and is loaded by {loaded_by}: "
        "every rank starts from the consensus (averaged) weights with fresh optimizer moments; per-rank "
        "state and RNG streams are not restored."
    )
    if scheduler is not None or scaler is not None:
        rank0 = files.load_rank_state(final, 0)
        if scheduler is not None and rank0["scheduler"] is not None:
            scheduler.load_state_dict(rank0["scheduler"])
        _load_scaler(scaler, rank0, final)
    return dict(meta["extra"])


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)
    logger.warning(message)


def _accelerate_scaler(optimizer: Any) -> Any | None:
    """The loss scaler that Accelerate's optimizer wrapper steps with (None for a bare optimizer)."""
    return getattr(optimizer, "scaler", None) if not isinstance(optimizer, DecentralizedAdam) else None


def _load_scaler(scaler: Any | None, state: dict[str, Any], final: Path) -> None:
    saved = state.get("scaler")
    if scaler is None or not scaler.is_enabled():
        return
    if saved is None:
        logger.warning("%s holds no loss-scaler state: the scaler keeps its initial scale", final)
        return
    scaler.load_state_dict(saved)


# ---------------------------------------------------------------------------- files


def _write_weights(module: nn.Module, directory: Path) -> None:
    """The consensus weights as safetensors (save_pretrained for Hugging Face models)."""
    save_pretrained = getattr(module, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(str(directory))
        return
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ImportError("checkpoints need safetensors: pip install safetensors") from None
    save_model(module, str(directory / files.WEIGHTS_NAME))


def _read_weights(module: nn.Module, directory: Path) -> None:
    """Load the consensus weights into ``module``, the way :func:`_write_weights` wrote them."""
    from_pretrained = getattr(type(module), "from_pretrained", None)
    if callable(from_pretrained) and (directory / "config.json").is_file():
        # save_pretrained may rename keys (transformers converts some architectures, MoE experts
        # among them, to their published layout) and shards large models; its loader undoes both
        loaded = from_pretrained(str(directory))
        module.load_state_dict(loaded.state_dict())
        return
    try:
        from safetensors.torch import load_model
    except ImportError:
        raise ImportError("checkpoints need safetensors: pip install safetensors") from None
    weights = directory / files.WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: the checkpoint has no consensus weights")
    load_model(module, str(weights))


# ---------------------------------------------------------------------------- helpers


def _unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (``.module``) or torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


@dataclass
class _Training:
    """The ranks that save or load together, and the optimizer whose state they hold."""

    optimizer: torch.optim.Optimizer  # the innermost optimizer (Accelerate's wrapper looked through)
    decentralized: Decentralized | None
    rank: int
    world_size: int
    device: torch.device
    shape: files.RunShape
    step: int | None

    @classmethod
    def of(cls, optimizer: Any) -> _Training:
        inner = optimizer
        while not isinstance(inner, DecentralizedAdam | A2CiD2) and isinstance(
            getattr(inner, "optimizer", None), torch.optim.Optimizer
        ):  # A2CiD2 holds a local optimizer too: stop at it
            inner = inner.optimizer
        if isinstance(inner, DecentralizedAdam | A2CiD2):
            return cls(inner, inner, inner.rank, inner.world_size, inner.device,
                       files.RunShape.of(inner, inner.world_size), inner.step_count)  # fmt: skip
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(
                f"expected a torch optimizer (a decentadam.DecentralizedAdam or A2CiD2, or the optimizer "
                f"of an All-Reduce run), got {type(optimizer).__name__}"
            )
        distributed = dist.is_available() and dist.is_initialized()
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        params = [p for group in inner.param_groups for p in group["params"]]
        device = params[0].device if params else torch.device("cpu")
        return cls(inner, None, rank, world_size, device, files.RunShape.of(None, world_size), None)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """A2CiD2's averagings paused (see :meth:`decentadam.A2CiD2.paused`); nothing for the others."""
        if isinstance(self.decentralized, A2CiD2):
            return self.decentralized.paused()
        return contextlib.nullcontext()

    def statuses(self, status: int) -> list[int]:
        """Every rank's ``status`` (_OK, _FAILED, _REFUSED), by rank: a collective, so also a barrier."""
        if self.world_size == 1:
            return [status]
        values = torch.zeros(self.world_size, dtype=torch.float32, device=self.device)
        values[self.rank] = status
        if self.decentralized is not None:
            self.decentralized.communicator.world_sum(values)
        else:
            dist.all_reduce(values)
        return [int(v) for v in values.tolist()]


_OK, _FAILED, _REFUSED = 0, 1, 2
_SHARED_FILESYSTEM = (
    "Every rank must write to the same directory: put the checkpoint on a filesystem shared by all "
    "nodes, and pass an absolute path (or the same working directory on every rank)."
)


def _raise_if_failed(status: list[int], error: Exception | None, others_failed: str) -> None:
    """Re-raise this rank's own ``error``; else raise if any other rank failed (all ranks raise)."""
    if error is not None:
        raise error
    failed = [rank for rank, value in enumerate(status) if value != _OK]
    if failed:
        raise RuntimeError(
            f"save_checkpoint: ranks {failed} {others_failed} (those ranks' own errors say more; the "
            "previous checkpoint, if any, is unchanged)"
        )


def _capture_rng() -> dict[str, Any]:
    """Every RNG state, as the plain values a rank file holds (tensors, tuples, numbers)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = files.plain_numpy_rng_state(numpy.random.get_state())
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(files.numpy_rng_state(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
