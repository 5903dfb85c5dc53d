"""Guards and helpers around ``torch.distributed``: launch checks, rank maps, consistency checks."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "check_launch_environment",
    "check_same_parameters",
    "env_local_world_size",
    "init_restartable_process_group",
    "is_initialized",
]


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def check_launch_environment() -> None:
    """Fail loudly when launched as several processes but no process group was initialised.

    ``accelerate launch --num_processes 4`` or ``torchrun --nproc_per_node 4`` set ``WORLD_SIZE``;
    a script that then never initialises ``torch.distributed`` (for instance Accelerate on a
    CPU-only machine without ``cpu=True``) would silently train 4 unrelated models.
    """
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world_size = int(value)
    except ValueError:
        raise ValueError(
            f"WORLD_SIZE must be an integer (the number of launched processes), got {value!r}; "
            "unset it or let torchrun / accelerate launch set it"
        ) from None
    if world_size > 1 and not is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={world_size} is set (the script was launched as {world_size} processes), but "
            "torch.distributed is not initialised, so every process would train alone. Call "
            "torch.distributed.init_process_group(...) first (backend 'gloo' on CPU, 'nccl' on GPU); "
            "with Accelerate on a CPU-only machine build Accelerator(cpu=True) or set "
            "ACCELERATE_USE_CPU=true."
        )


def env_local_world_size() -> int:
    """Ranks per node from ``LOCAL_WORLD_SIZE`` (set by torchrun and accelerate launch), else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {value!r}") from None
    if size < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {size}")
    return size


def check_same_parameters(param_groups: Sequence[Sequence[Tensor]], group: dist.ProcessGroup | None) -> None:
    """Raise when ranks hold different parameters: the layout the communication buckets are built from.

    Compares, across ranks, the number of param groups and of tensors in each, and every tensor's
    shape, dtype, device type and ``requires_grad`` (frozen tensors are left out of the buckets), so
    that a mismatch fails here with its cause instead of at the first exchange. One small
    all-reduce of a fingerprint; called once, at construction.
    """
    signature = "|".join(
        ";".join(f"{tuple(p.shape)}:{p.dtype}:{p.device.type}:{p.requires_grad}" for p in params)
        for params in param_groups
    )
    digest = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:7], "big")
    flat = [p for params in param_groups for p in params]
    device = flat[0].device if flat else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.tensor([digest, len(flat)], dtype=torch.int64, device=device)
    low, high = local.clone(), local.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        trainable = sum(p.numel() for p in flat if p.requires_grad)
        raise ValueError(
            "ranks hold different parameters: the param groups, parameter count, shapes, dtypes, devices "
            "or which parameters are trainable (requires_grad) differ across ranks (this rank: "
            f"{len(param_groups)} groups, {len(flat)} tensors, {sum(p.numel() for p in flat)} elements, "
            f"{trainable} trainable). Build the same model on every rank, freeze the same parameters, "
            "and pass the same param groups in the same order, before creating the optimizer."
        )


def init_restartable_process_group(timeout_s: float = 0.0) -> None:
    """Under a launcher's restarts, start the default process group with this attempt's own keys.

    torchrun's agent (also behind ``accelerate launch --max_restarts``) keeps one store for every
    attempt, and the keys of a failed attempt stay in it: the next attempt's gloo process groups
    (DecentralizedAdam's exchange groups) read the dead processes' addresses from them and wait on
    those forever (torch 2.13; the store sharing is pytorch/pytorch#135712). Call it first, before
    ``Accelerator()`` or ``TrainingArguments()``, or instead of ``dist.init_process_group``: every
    key of the attempt goes under ``attempt-N/`` (``TORCHELASTIC_RESTART_COUNT``), and Accelerate
    and the Trainer use this group. ``timeout_s`` (0: 30 minutes) bounds every collective. Does
    nothing outside torchrun's agent, in one process, or when a group exists already.
    """
    import datetime

    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if attempt is None or world_size < 2 or dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else datetime.timedelta(minutes=30)
    rank = int(os.environ["RANK"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0  # no agent store
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(address, port, is_master=hosted, timeout=timeout)
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=PrefixStore(f"attempt-{attempt}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
