"""Communication buckets: parameters packed into flat buffers, and the exact averages over all ranks.

A :class:`Bucket` holds parameters of one param group, device and dtype; its ``buffer`` is the
flat send and receive buffer of its exchanges (the optimizer's only extra copy of them). The
functions here act on a list of buckets through the world collectives of a communicator
(:class:`~decentadam.collectives.WorldCollectives`);
:class:`~decentadam.DecentralizedAdam` exposes them as methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from decentadam.collectives import Handle, WorldCollectives

__all__ = [
    "AveragedParameters",
    "Bucket",
    "average",
    "broadcast",
    "consensus_stats",
    "make_buckets",
    "views_like",
]


@dataclass(eq=False)
class Bucket:
    """Parameters of one param group, device and dtype, averaged as one flat buffer."""

    group_index: int
    params: list[Tensor]
    buffer: Tensor  # (numel,) send and receive buffer
    views: list[Tensor]  # views of ``buffer`` shaped like ``params``
    handle: Handle | None = None  # exchange in flight
    pending_size: int = 0  # > 1: buffer holds (or will hold) the sum over a group of that many ranks

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def flatten(self) -> Tensor:
        """A new flat copy of the parameters, ``(numel,)``."""
        return torch.cat([p.reshape(-1) for p in self.params])


def make_buckets(param_groups: Sequence[dict[str, Any]], bucket_bytes: int) -> list[Bucket]:
    """Pack trainable parameters, last-registered first (about the order gradients get ready)."""
    buckets: list[Bucket] = []
    for index, group in enumerate(param_groups):
        open_buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for p in reversed(group["params"]):
            if not p.requires_grad:
                continue
            key = (p.device, p.dtype)
            members = open_buckets.setdefault(key, [])
            if members and sizes[key] + p.numel() * p.element_size() > bucket_bytes:
                buckets.append(_new_bucket(index, members))
                members = open_buckets[key] = []
            members.append(p)
            sizes[key] = sum(q.numel() * q.element_size() for q in members)
        buckets.extend(_new_bucket(index, members) for members in open_buckets.values() if members)
    return buckets


def _new_bucket(group_index: int, params: list[Tensor]) -> Bucket:
    buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    return Bucket(group_index=group_index, params=params, buffer=buffer, views=views_like(buffer, params))


def check_no_gradients(frozen: list[Tensor]) -> None:
    """Raise when a parameter left out of the buckets (frozen at construction) has a gradient."""
    for p in frozen:
        if p.grad is not None:
            raise RuntimeError(
                f"DecentralizedAdam: a parameter of shape {tuple(p.shape)} has a gradient but was "
                "frozen (requires_grad=False) when the optimizer was built, so it would be neither "
                "updated nor averaged. Unfreeze parameters before building DecentralizedAdam, or "
                "build a new one after unfreezing (carry the state over with state_dict() and "
                "load_state_dict())."
            )


def views_like(flat: Tensor, params: list[Tensor]) -> list[Tensor]:
    """Views of the 1-D ``flat`` shaped like ``params``, back to back."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


@torch.no_grad()
def broadcast(buckets: list[Bucket], others: list[Tensor], communicator: WorldCollectives) -> None:
    """Every rank takes rank 0's parameters: one broadcast per bucket, then one per other tensor."""
    for bucket in buckets:
        torch._foreach_copy_(bucket.views, bucket.params)
        communicator.broadcast(bucket.buffer)
        torch._foreach_copy_(bucket.params, bucket.views)
    for tensor in others:
        communicator.broadcast(tensor.data)


@torch.no_grad()
def average(
    buckets: list[Bucket],
    communicator: WorldCollectives,
    restore: bool,
    after_restore: Callable[[], None] | None = None,
) -> AveragedParameters:
    """Set the parameters to their exact mean over all ranks (a collective); see the returned object.

    ``after_restore`` runs once the local parameters are back (with ``restore=True``).
    """
    saved = []
    for bucket in buckets:
        local = bucket.flatten()
        mean = local.clone() if restore else local
        communicator.world_sum(mean)
        mean.div_(communicator.world_size)
        torch._foreach_copy_(bucket.params, views_like(mean, bucket.params))
        if restore:
            saved.append(local)
        else:
            bucket.pending_size = 0  # everyone holds the same x: mixing is the identity
    return AveragedParameters(buckets, saved if restore else None, after_restore if restore else None)


@torch.no_grad()
def consensus_stats(
    buckets: list[Bucket], communicator: WorldCollectives, device: torch.device
) -> tuple[float, float]:
    """(mean_i ||x_i - x_bar||^2, ||x_bar||^2) in float64.

    Costs one all-reduce of a float64 copy of every bucket (a full copy of the parameters) and one
    of a scalar.
    """
    world_size = communicator.world_size
    total = torch.zeros((), dtype=torch.float64, device=device)
    mean_norm = torch.zeros((), dtype=torch.float64, device=device)
    for bucket in buckets:
        local = bucket.flatten().double()
        mean = local.clone()
        communicator.world_sum(mean)
        mean.div_(world_size)
        total += (local - mean).square().sum()
        mean_norm += mean.square().sum()
    communicator.world_sum(total)
    return float(total.item()) / world_size, float(mean_norm.item())


class AveragedParameters:
    """Returned by :func:`average`: a context manager that puts each rank's local parameters back."""

    def __init__(
        self,
        buckets: list[Bucket],
        saved: list[Tensor] | None,
        after_restore: Callable[[], None] | None = None,
    ) -> None:
        self._buckets = buckets
        self._saved = saved
        self._after_restore = after_restore

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    @torch.no_grad()
    def restore(self) -> None:
        """Put back each rank's local parameters (no-op with ``restore=False`` or when done)."""
        if self._saved is None:
            return
        for bucket, saved in zip(self._buckets, self._saved, strict=True):
            torch._foreach_copy_(bucket.params, views_like(saved, bucket.params))
        self._saved = None
        if self._after_restore is not None:
            after, self._after_restore = self._after_restore, None
            after()
