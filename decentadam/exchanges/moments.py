r"""Second moments shared between ranks: the nodes' estimate, and the ranks' ``global`` one.

The nodes' estimate shared (``GroupGradient(share_second_moment_every=k)`` with
``intra_node="all_reduce"``). Where a gradient is sparse within a step (an embedding row whose token
only one rank of one node saw), All-Reduce's step needs that node to step ``N`` times its own Adam
step, and the nodes' own ``A`` (:mod:`decentadam.exchanges.node_gradients`) and the floor ``V / N``
allow ``sqrt(N)``. Every k-th step the node's ``A``, rounded to bfloat16, travels with the
parameters to the group of that step (an asynchronous sum, like the parameters'); when it arrives,
at the next step and before that step's ``z`` joins it, ``A`` becomes the group's mean::

    A = bf16sum_{ranks j of the group}(bf16(A_j)) / q;   A = beta2 * A + (1 - beta2) * z
    v = max(A / (1 - beta2**u), V / (1 - beta2**t) / N**2)        # the floor lowered to V / N**2

(``A`` is alike on a node's ranks, so the mean over the group's ``q`` ranks is the mean over its
nodes; ``u`` counts the updates as before.) With the nodes' mean ``A`` and the floor ``V / N**2``,
a node alone in seeing a token steps ``N`` times its own step there, and the mean of the nodes'
steps is All-Reduce's; either change alone does not give it. The sum travels in bfloat16 for any
group size: ``numel * 2 / k`` bytes per step on top of the parameters' (1 byte per parameter and
step at ``k = 2``); it arrives alike on every member, so the ranks of a node stay replicas. Over two
nodes of two ranks with gloo's hierarchical sum it is rounded once (but for a bucket's last ``numel
% L`` values); a flat ring (NCCL, more nodes) may round it at every hop, which leaves ``A`` within a
few bfloat16 roundings (2**-9 each) of its exact mean. Its bytes can cost more time than its steps
save where the exchange bounds the step: docs/choosing.md has both measurements, and the runtime
model (:mod:`decentadam.runtime_model`, ``--share-second-moment-every 2``) tells whether it hides
behind compute.

The ranks' estimates averaged (:class:`~decentadam.options.Global`). At every exact average over
all ranks each rank sends its own corrected second moment (``AllRanks``'s, bias-corrected) in
bfloat16 with the parameters; at the next step the mean ``P`` (state ``shared_sq``) replaces each
rank's estimate: ``v = max(P, V / (1 - beta2**t) / n**2)``.

A sum in flight is folded into the state by ``settle`` (``state_dict``, averaging, checkpoints,
``close``), so a resume is exact. Memory: per bucket one bfloat16 buffer.
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
from decentadam.optim.accum_adamw import corrected_second_moment

__all__ = ["MomentShares"]


@dataclass(eq=False)
class _Share:
    """One bucket's second moment in bfloat16: sent, and the group's sum received in place."""

    total: Tensor  # (numel,) bfloat16
    views: list[Tensor]  # views of ``total`` shaped like the bucket's parameters
    pending: Pending = field(default_factory=Pending)

    @classmethod
    def of(cls, bucket: Bucket) -> _Share:
        total = torch.empty(bucket.buffer.numel(), dtype=torch.bfloat16, device=bucket.buffer.device)
        return cls(total, views_like(total, bucket.params))


class MomentShares:
    """The nodes' ``A`` every ``every`` steps, or (``noise_ranks`` set: ``global``) each rank's own
    estimate at the exact averages, summed over the group and folded in as its mean."""

    def __init__(
        self,
        link: Link,
        optimizer: Optimizer,
        buckets: Sequence[Bucket],
        every: int,
        global_ranks: int | None,
        floored: bool = True,
    ) -> None:
        self.link, self.optimizer, self.every, self.floored = link, optimizer, every, floored
        self.global_ranks = global_ranks  # n of the ranks' own estimates (global); None: the nodes' A
        self._shares = {id(b): _Share.of(b) for b in buckets}

    def start(self, bucket: Bucket, step: int) -> None:
        """Send this rank's estimate (bf16) to the group of ``step`` when one is due there."""
        share = self._shares[id(bucket)]
        group = self.link.topology.group_of(self.link.rank, step)
        if self.global_ranks is not None:  # at the exact averages: this rank's all_ranks v
            if len(group) != self.link.world_size:
                return
            beta2 = self.optimizer.param_groups[bucket.group_index]["betas"][1]
            for param, view in zip(bucket.params, share.views, strict=True):
                st = self.optimizer.state[param]
                if "exp_avg_sq" not in st:  # no gradient yet on this rank: no estimate to give
                    view.zero_()
                else:
                    view.copy_(corrected_second_moment(st, beta2, self.global_ranks, self.floored))
        elif step % self.every or len(group) == 1:
            return
        else:
            for param, view in zip(bucket.params, share.views, strict=True):
                # every parameter has A: the node's sum gave it a gradient and z before this update
                view.copy_(self.optimizer.state[param]["group_sq"])  # rounds to bfloat16
        share.pending.handle = self.link.start(share.total, group, step, "second moment")
        share.pending.size = len(group)

    def finish(self, bucket: Bucket) -> None:
        self.settle(bucket)

    def settle(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Wait for the bucket's sum, if one is pending, and replace the estimate by the group's mean."""
        share = self._shares[id(bucket)]
        q = self.link.take(share.pending, "second moment", timeout)
        if q <= 1:
            return
        key = "shared_sq" if self.global_ranks is not None else "group_sq"
        for param, total in zip(bucket.params, share.views, strict=True):
            st = self.optimizer.state[param]
            if key not in st:
                st[key] = torch.empty_like(param)
            st[key].copy_(total).div_(q)

    def abandon(self) -> None:
        """Forget the sums in flight: the estimates keep what they had."""
        for share in self._shares.values():
            share.pending = Pending()
