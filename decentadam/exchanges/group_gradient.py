r"""The second moment from the exchange group's gradients (``GroupGradient`` under gossip).

A noise estimate over time (:class:`~decentadam.options.AllRanks`) cannot separate the noise from
the mean gradient's drift; gradients of the same step can. Every ``v_every`` (``k``) steps, on
steps whose exchange group has more than one member, a rank also sends its gradient, rounded to
bfloat16, to that group with its parameters (an asynchronous sum that travels during the next
forward/backward like them). When the sum arrives, at the next step, with ``gbar`` the group's
mean over its ``q`` ranks and ``g_i`` the rank's own rounded gradient::

    z = gbar**2 - (g_i**2 - gbar**2) * (1/q - 1/n) / (1 - 1/q)   # E[z] = mu^2 + sigma^2 / n
    A = beta2**k * A + (1 - beta2**k) * z;   u = u + 1
    v = max(A / (1 - beta2**(k u)), V / (1 - beta2**t) / n)       # in place of all_ranks' v

(``E[gbar^2] = mu^2 + sigma^2 / q``, ``E[g_i^2 - gbar^2] = sigma^2 (1 - 1/q)``; on a group of all
``n`` ranks ``z`` is ``gbar^2``, All-Reduce's.) Until the first sum arrives the step is
``all_ranks``'s; the momentum stays the rank's own. ``A`` and ``u`` are the state keys ``group_sq``
and ``group_updates``; a sum still in flight is waited for and folded into ``A`` by ``settle``
(so by ``state_dict``, averaging, checkpoints and ``close``). The sum of a group of two ranks
travels in bfloat16, ``gbar = bf16(g_a + g_b) / 2``: one rounding, and bitwise the same on both
ranks (``a + b`` commutes), for ``numel * 2 / k`` bytes per step on top of the parameters' (a
quarter of float32 parameters' at ``k = 2``). A larger group's travels in float32, ``numel * 4 /
k``: the order in which gloo adds its members is not fixed, and a bfloat16 sum of many values would
lose precision. Memory: ``A``, and per bucket a bfloat16 copy of the gradient and a send buffer per
group size (bfloat16 for pairs, float32 for larger groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import Tensor
from torch.optim import Optimizer

from decentadam.buckets import Bucket, views_like
from decentadam.exchanges.link import Link, Pending

__all__ = ["GroupGradients", "group_gradient_sq"]


@dataclass(eq=False)
class _GradientSum:
    """One bucket's gradient exchange: what it sends and, per group size, where the sum arrives."""

    own: Tensor  # (numel,) bfloat16: this rank's gradient as sent, g_i
    own_views: list[Tensor]  # views of ``own`` shaped like the bucket's parameters
    pair: Tensor | None  # (numel,) bfloat16: ``own`` sent to a group of 2, their sum received
    wide: Tensor | None  # (numel,) float32: ``own`` sent to a larger group, its sum received
    pending: Pending = field(default_factory=Pending)

    @classmethod
    def of(cls, bucket: Bucket, sizes: set[int]) -> _GradientSum:
        """Buffers for the sizes (> 1) of the groups this rank exchanges with."""
        device, numel = bucket.buffer.device, bucket.buffer.numel()
        own = torch.empty(numel, dtype=torch.bfloat16, device=device)
        pair = torch.empty(numel, dtype=torch.bfloat16, device=device) if 2 in sizes else None
        wide = torch.empty(numel, dtype=torch.float32, device=device) if max(sizes, default=0) > 2 else None
        return cls(own, views_like(own, bucket.params), pair, wide)

    def buffer(self, q: int) -> Tensor:
        """The send buffer of a group of ``q > 1`` ranks (bfloat16 for pairs, float32 for larger)."""
        total = self.pair if q == 2 else self.wide
        assert total is not None, f"no gradient buffer for a group of {q} ranks"
        return total


def group_gradient_sq(total: Tensor, own: Tensor, q: int, n: int) -> Tensor:
    """``z = gbar**2 - (g_i**2 - gbar**2) (1/q - 1/n) / (1 - 1/q)`` with ``gbar = total / q`` (in
    place in a float32 ``total``; a bfloat16 one, a pair's, is read into a new float32 tensor), in
    float32."""
    mean = total.div_(q) if total.dtype == torch.float32 else total.float().div_(q)
    mean_sq = mean.square()
    share = (1.0 / q - 1.0 / n) / (1.0 - 1.0 / q)
    spread = own.to(torch.float32, copy=True).square_().sub_(mean_sq).mul_(share)  # the one other temporary
    return mean_sq.sub_(spread)


class GroupGradients:
    """Every ``v_every`` steps each bucket's bf16 gradient summed over the group, folded into ``A``."""

    def __init__(self, link: Link, optimizer: Optimizer, buckets: Sequence[Bucket], v_every: int) -> None:
        self.link, self.optimizer, self.v_every = link, optimizer, v_every
        topology, rank = link.topology, link.rank
        sizes = {len(g) for g in topology.distinct_groups() if rank in g}
        self._sums = {id(b): _GradientSum.of(b, sizes) for b in buckets}

    def start(self, bucket: Bucket, step: int) -> None:
        """Every k steps, send g_i (bf16) to the group of ``step``."""
        if step % self.v_every:
            return
        group = self.link.topology.group_of(self.link.rank, step)
        if len(group) == 1:
            return
        exchange = self._sums[id(bucket)]
        for param, view in zip(bucket.params, exchange.own_views, strict=True):
            if param.grad is None:  # unused this step on this rank: its gradient is 0 (as under DDP)
                view.zero_()
            else:
                view.copy_(param.grad)  # rounds to bfloat16
        total = exchange.buffer(len(group))
        total.copy_(exchange.own)
        exchange.pending.handle = self.link.start(total, group, step, "gradient")
        exchange.pending.size = len(group)

    def finish(self, bucket: Bucket) -> None:
        self.settle(bucket)

    def settle(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Wait for the bucket's gradient sum, if one is pending, and fold its z into A."""
        exchange = self._sums[id(bucket)]
        q = self.link.take(exchange.pending, "gradient", timeout)
        if q <= 1:
            return
        z = group_gradient_sq(exchange.buffer(q), exchange.own, q, self.link.world_size)  # (numel,) float32
        decay = self.optimizer.param_groups[bucket.group_index]["betas"][1] ** self.v_every
        for param, z_i in zip(bucket.params, views_like(z, bucket.params), strict=True):
            st = self.optimizer.state[param]
            if "exp_avg" not in st:  # never stepped: no moments for A to go with yet
                continue
            if "group_sq" not in st:
                st["group_sq"], st["group_updates"] = torch.zeros_like(param), 0
            st["group_sq"].mul_(decay).add_(z_i, alpha=1.0 - decay)
            st["group_updates"] += 1

    def abandon(self) -> None:
        """Forget the sums in flight: ``A`` keeps what it had."""
        for exchange in self._sums.values():
            exchange.pending = Pending()
