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
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
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


def check_same_parameters(params: Sequence[Tensor], group: dist.ProcessGroup | None) -> None:
    """Raise when ranks hold different parameter lists (count, shapes or dtypes).

    One small all-reduce of a fingerprint; called once, at construction.
    """
    signature = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    digest = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:7], "big")
    device = params[0].device if params else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.tensor([digest, len(params)], dtype=torch.int64, device=device)
    low, high = local.clone(), local.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ValueError(
            "ranks hold different parameters: parameter count or shapes differ across ranks "
            f"(this rank: {len(params)} tensors, {sum(p.numel() for p in params)} elements). Build the "
            "same model on every rank, and pass its parameters in the same order, before creating the "
            "optimizer."
        )
