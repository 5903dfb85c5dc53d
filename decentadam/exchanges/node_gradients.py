r"""Gradients averaged inside nodes (``Setting(intra_node="all_reduce")``).

The ``L = local_world_size`` ranks of a node (consecutive ranks) all-reduce their gradients before
each step, as DDP does (over the node's fast link), and take the same step from the node's mean
gradient: they stay replicas, and only the ``N = n / L`` nodes gossip, on the topology built for
the ``N`` nodes (:func:`decentadam.topology.over_nodes`; a node alone does not communicate). A
rank's step and the point where it takes its next gradient then carry the noise of ``L`` ranks'
batches, not of one. The all-reduce sends the gradient bytes on the fast link (none more across
nodes). With :class:`~decentadam.options.GroupGradient` it sends ``g**2`` with ``g`` (twice the
bytes), so that the estimate needs no bytes of its own and no delay: with ``g_L`` the node's mean
of ``g`` and ``s_L`` its mean of ``g**2`` minus ``g_L**2`` (``E[s_L] = sigma^2 (1 - 1/L)``), every
step, before the update::

    z = g_L**2 - s_L * (1/L - 1/n) / (1 - 1/L)    # E[z] = mu^2 + sigma^2 / n, the same on the node
    A = beta2 * A + (1 - beta2) * z;   u = u + 1;   v = max(A / (1 - beta2**u), V / (1 - beta2**t) / N)

(``V`` is of ``g_L``; :class:`~decentadam.options.AllRanks` corrects the node's mean for ``N``
instead of ``n``, and :class:`~decentadam.options.Local` keeps the node's own.) A parameter without
a gradient on a rank counts as a zero gradient there, and after the step every parameter's
``.grad`` holds the node's mean gradient. Memory: per bucket a buffer of its parameters' size
(twice it with the squares), and ``A`` (state ``group_sq``, ``u`` ``group_updates``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor
from torch.optim import Optimizer

from decentadam.buckets import Bucket, views_like
from decentadam.collectives import Handle
from decentadam.exchanges.link import Link
from decentadam.topology import Group

__all__ = ["NodeGradients"]


@dataclass(eq=False)
class _NodeSum:
    """One bucket's all-reduce: its gradients, then (for the estimate) their squares."""

    buffer: Tensor  # (numel or 2 numel,) in the parameters' dtype: g_i (and g_i**2) sent, sums received
    handle: Handle | None = None  # the sum in flight
    started: bool = False  # started for this step, not yet averaged into the gradients

    @classmethod
    def of(cls, bucket: Bucket, squares: bool) -> _NodeSum:
        flat = bucket.buffer
        size = (2 if squares else 1) * flat.numel()
        return cls(torch.empty(size, dtype=flat.dtype, device=flat.device))


class NodeGradients:
    """Each bucket's gradients (and their squares) summed over the node, averaged before the update."""

    def __init__(
        self, link: Link, optimizer: Optimizer, buckets: Sequence[Bucket], node: Group, squares: bool
    ) -> None:
        self.link, self.optimizer, self.node = link, optimizer, node
        self._sums = {id(b): _NodeSum.of(b, squares) for b in buckets}

    def start(self, bucket: Bucket, step: int) -> None:
        """Start the node's sum of this step's gradients (once per step; ``step`` names it in errors)."""
        exchange = self._sums[id(bucket)]
        if exchange.started:
            return
        numel = bucket.buffer.numel()
        grads = exchange.buffer[:numel]
        for param, view in zip(bucket.params, views_like(grads, bucket.params), strict=True):
            if param.grad is None:  # unused on this rank: its gradient is 0 (as under DDP)
                view.zero_()
            else:
                view.copy_(param.grad)
        if exchange.buffer.numel() > numel:  # the estimate: the squares too
            torch.mul(grads, grads, out=exchange.buffer[numel:])
        exchange.handle = self.link.start(exchange.buffer, self.node, step, "node gradient", counted=True)
        exchange.started = True

    def finish(self, bucket: Bucket) -> None:
        """Give every parameter the node's mean gradient; with the squares fold ``z`` into A."""
        exchange = self._sums[id(bucket)]
        self.start(bucket, self.link.clock())  # overlap="backward": from the bucket's gradient hook
        if exchange.handle is not None:
            handle, exchange.handle = exchange.handle, None
            self.link.wait(handle, "node gradient")
        exchange.started = False
        size, numel = len(self.node), bucket.buffer.numel()
        total = exchange.buffer.div_(size)
        mean, mean_sq = total[:numel], total[numel:]
        for param, view in zip(bucket.params, views_like(mean, bucket.params), strict=True):
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)
        if not mean_sq.numel():  # another second moment: only the gradients were summed
            return
        square = mean.square()  # the one temporary: z is built in it, s_L in the received squares
        spread = mean_sq.sub_(square)  # E = sigma^2 (1 - 1/L)
        z = square.sub_(spread.mul_((1.0 / size - 1.0 / self.link.world_size) / (1.0 - 1.0 / size)))
        decay = self.optimizer.param_groups[bucket.group_index]["betas"][1]
        for param, z_i in zip(bucket.params, views_like(z, bucket.params), strict=True):
            st = self.optimizer.state[param]
            if "group_sq" not in st:
                st["group_sq"], st["group_updates"] = torch.zeros_like(param), 0
            st["group_sq"].mul_(decay).add_(z_i, alpha=1.0 - decay)
            st["group_updates"] += 1

    def settle(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Nothing outside a step: the node's sum is started and folded within one."""

    def abandon(self) -> None:
        """Nothing kept: a sum a dead peer never finished is not folded into the state."""
