"""The consensus model (exact average over ranks) and the health metrics of decentralized training.

Every function here is a collective: call it on every rank at the same point of training.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from decentadam.asynchronous.a2cid2 import A2CiD2
from decentadam.decentralized import CommStats, DecentralizedAdam

__all__ = ["Decentralized", "MetricsHook", "averaged", "metrics", "register_metrics_hook", "unwrap_optimizer"]

Decentralized: TypeAlias = DecentralizedAdam | A2CiD2
"""The optimizers of decentralized training: synchronous gossip, or asynchronous (A2CiD2)."""

logger = logging.getLogger(__name__)


def unwrap_optimizer(optimizer: Any) -> Decentralized:
    """The :class:`DecentralizedAdam` or :class:`A2CiD2` inside ``optimizer`` (as Accelerate's
    ``AcceleratedOptimizer``)."""
    inner = optimizer
    for _ in range(4):  # AcceleratedOptimizer -> (DeepSpeed-style wrappers) -> the optimizer
        if isinstance(inner, DecentralizedAdam | A2CiD2):
            return inner
        inner = getattr(inner, "optimizer", None)
    raise TypeError(
        f"expected a decentadam.DecentralizedAdam or decentadam.A2CiD2 (or an Accelerate wrapper of one), "
        f"got {type(optimizer).__name__}"
    )


@contextlib.contextmanager
def averaged(model: nn.Module, optimizer: Any, *, restore: bool = True) -> Iterator[nn.Module]:
    """Inside the block, ``model`` holds the exact average over ranks: parameters and float buffers.

    ``with averaged(model, optimizer): evaluate(model)`` evaluates (or saves) the consensus model;
    on exit each rank gets its own parameters and buffers (BatchNorm running statistics) back, so
    training continues as if nothing happened. With ``restore=False`` every rank keeps the average.
    """
    opt = unwrap_optimizer(optimizer)
    params = opt.average_parameters(restore=restore)
    saved = _average_buffers(model, opt, keep_local=restore)
    try:
        yield model
    finally:
        with torch.no_grad():
            for buffer, local in saved:
                buffer.copy_(local)
        params.restore()


def _average_buffers(model: nn.Module, opt: Decentralized, keep_local: bool) -> list[tuple[Tensor, Tensor]]:
    """Average floating-point buffers over ranks in place; return (buffer, local copy) pairs.

    Integer buffers (``num_batches_tracked``) advance in lockstep on every rank and are left alone.
    """
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    saved: list[tuple[Tensor, Tensor]] = []
    if opt.world_size == 1 or not buffers:
        return saved
    with torch.no_grad():
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for b in buffers:
            by_kind.setdefault((b.device, b.dtype), []).append(b)
        for members in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in members])  # (sum of numel,)
            if keep_local:
                saved.extend((b, b.detach().clone()) for b in members)
            opt.communicator.world_sum(flat)
            flat.div_(opt.world_size)
            offset = 0
            for b in members:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
    return saved


def metrics(optimizer: Any, since: CommStats | None = None) -> dict[str, float]:
    """Health metrics of decentralized training, averaged over ranks (a collective).

    Returns ``decentadam/consensus_distance`` (mean_i ||x_i - x_bar||^2),
    ``decentadam/consensus_distance_rel`` (divided by ||x_bar||^2), and, per optimizer step since
    ``since`` (a ``optimizer.stats.snapshot()``; default: since construction),
    ``decentadam/comm_wait_ms`` (time blocked waiting for exchanges, mean over ranks: the
    communication that compute did not hide) and ``decentadam/comm_mb`` (megabytes sent per rank).
    Costs an all-reduce of a float64 copy of the parameters (see
    :meth:`~decentadam.DecentralizedAdam.consensus_stats`) and two small ones.
    """
    opt = unwrap_optimizer(optimizer)
    now, before = opt.stats, since if since is not None else CommStats()
    steps = max(now.steps - before.steps, 1)
    distance, mean_norm = opt.consensus_stats()
    relative = distance / mean_norm if mean_norm > 0 else 0.0
    counters = torch.tensor(
        [now.wait_seconds - before.wait_seconds, float(now.bytes_sent - before.bytes_sent)],
        dtype=torch.float64,
    )
    if opt.world_size > 1:
        counters = counters.to(opt.device)
        opt.communicator.world_sum(counters)
        counters = counters.cpu() / opt.world_size
    return {
        "decentadam/consensus_distance": distance,
        "decentadam/consensus_distance_rel": relative,
        "decentadam/comm_wait_ms": 1e3 * float(counters[0]) / steps,
        "decentadam/comm_mb": float(counters[1]) / steps / 2**20,
    }


class MetricsHook:
    """Calls ``log_fn(metrics, step)`` every ``every`` optimizer steps (see :func:`register_metrics_hook`)."""

    def __init__(self, optimizer: Any, every: int, log_fn: Callable[[dict[str, float], int], object]) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 optimizer steps, got {every}")
        self.optimizer = unwrap_optimizer(optimizer)
        self.every = every
        self.log_fn = log_fn
        self._since = self.optimizer.stats.snapshot()
        self.handle: RemovableHandle = self.optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        step = self.optimizer.step_count
        if step % self.every:
            return
        values = metrics(self.optimizer, since=self._since)
        self._since = self.optimizer.stats.snapshot()
        self.log_fn(values, step)

    def remove(self) -> None:
        self.handle.remove()


def register_metrics_hook(
    optimizer: Any, every: int, log_fn: Callable[[dict[str, float], int], object]
) -> MetricsHook:
    """Log :func:`metrics` every ``every`` optimizer steps through ``log_fn(values, step)``.

    The metrics are collectives, run on every rank from an optimizer step post-hook; nothing is
    exchanged in between, so their cost (see :func:`metrics`) comes once every ``every`` steps.
    With Accelerate pass ``accelerator.log`` (it writes only on the main process). ``.remove()``
    detaches.
    """
    return MetricsHook(optimizer, every, log_fn)
