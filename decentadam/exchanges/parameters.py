r"""The parameter exchange: ``x_i <- sum_j W_ij(t) x_j(t)``, of the parameters or of bf16 updates.

At the end of step ``t`` each bucket starts an asynchronous sum of ``x_i(t+1)`` over its group of
step ``t+1``, which travels during the next forward/backward; step ``t+1`` waits for it just before
mixing and takes the mean (a group of one rank sends nothing).

Updates instead of parameters (``Setting(exchange="bf16_updates")``). A rank sends, in bfloat16,
how far its parameters moved from a reference point ``r`` that every member of its group holds
bitwise alike, instead of its float32 parameters (half the bytes). With ``q_i = bf16(x_i - r)`` and
the group's sum ``S`` of the ``q``'s over its ``m`` ranks, the mixing is::

    x_i = x_i + S / m - q_i;   r = r + S / m

so the group's mean of ``x`` is exactly the mean of what its ranks held (``sum_i (S/m - q_i) =
0``), each rank keeps its own rounding residual (sent with its next update), and the ranks'
parameters differ only by those residuals: the same mixing as ``"parameters"`` up to a rounding of
the step (2**-9 of it), not of the weights. ``r`` starts at the broadcast parameters and is
optimizer state (the key ``exchange_ref``, one copy of the parameters), so checkpoints and exact
resumes carry it (a state saved without it, or with other groups, is resumed with one exchange of
the whole parameters, after which ``r`` is their mean). ``r`` is alike on a rank's one fixed group
(``topology="complete"``; with ``intra_node="all_reduce"``, any topology over 2 nodes), or, where
the groups change, on every rank: it then moves only at the exact averages over all ranks
(``average_every``); :meth:`~decentadam.options.Setting.schedule` refuses the rest. The sum must
arrive bitwise the same on every member, as gloo's and NCCL's all-reduce deliver it (each element
is reduced once and then copied), or ``r`` would drift apart. Memory: ``r``, and per bucket two
bfloat16 buffers (the update sent and the sum received).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from decentadam.buckets import Bucket, views_like
from decentadam.exchanges.link import Link
from decentadam.topology import changing_groups, communicates

__all__ = ["ParameterExchange"]


@dataclass(eq=False)
class _Updates:
    """One bucket's bf16 update buffers: r, and the update sent and summed."""

    ref: Tensor  # (numel,) in the parameters' dtype: r, the reference point alike on the group
    ref_views: list[Tensor]  # views of ``ref`` shaped like the bucket's parameters (their state)
    own: Tensor  # (numel,) bfloat16: q_i = bf16(x_i - r), as sent
    own_views: list[Tensor]  # views of ``own`` shaped like the bucket's parameters
    total: Tensor  # (numel,) bfloat16: q_i sent, the group's sum S received
    whole: bool = False  # the next exchange sends the parameters (r was not in a loaded state)

    @classmethod
    def of(cls, bucket: Bucket) -> _Updates:
        flat = bucket.buffer
        ref = torch.empty_like(flat)
        own = torch.empty(flat.numel(), dtype=torch.bfloat16, device=flat.device)
        params = bucket.params
        return cls(ref, views_like(ref, params), own, views_like(own, params), torch.empty_like(own))


class ParameterExchange:
    """Each bucket's parameters (or bf16 updates from ``r``) summed over its group, then mixed."""

    def __init__(self, link: Link, buckets: Sequence[Bucket], bf16_updates: bool) -> None:
        self.link = link
        # r moves with a rank's one fixed group, or with the exact average over every rank
        self._fixed_groups = changing_groups(link.topology) is None
        self._updates: dict[int, _Updates] = {}
        if bf16_updates and communicates(link.topology):  # no r where no rank ever sends (one node)
            self._updates = {id(b): _Updates.of(b) for b in buckets}

    @property
    def whole(self) -> bool:
        """The next exchange sends the whole parameters (bf16 updates without a loaded ``r``)."""
        return any(updates.whole for updates in self._updates.values())

    def init_references(self, buckets: Sequence[Bucket], state: dict[Tensor, dict[str, Any]]) -> None:
        """r: the (broadcast) parameters, alike on every rank, kept as ``state[p]["exchange_ref"]``."""
        for bucket in buckets:
            refs = self._updates.get(id(bucket))
            if refs is None:
                continue
            with torch.no_grad():
                torch._foreach_copy_(refs.ref_views, bucket.params)
            for param, view in zip(bucket.params, refs.ref_views, strict=True):
                state[param]["exchange_ref"] = view

    def load_references(
        self, buckets: Sequence[Bucket], state: dict[Tensor, dict[str, Any]], same_groups: bool
    ) -> None:
        """After loading state: copy each parameter's ``exchange_ref`` into its bucket's flat r. Where
        the loaded state has none (saved with exchange="parameters"), or was saved with other groups
        (``same_groups`` false: their r need not be alike on the new group), the next exchange sends
        the whole parameters and r becomes their mean."""
        for bucket in buckets:
            updates = self._updates.get(id(bucket))
            if updates is None:
                continue
            loaded = [state[p].get("exchange_ref") for p in bucket.params]
            updates.whole = not same_groups or any(ref is None for ref in loaded)
            for param, view, ref in zip(bucket.params, updates.ref_views, loaded, strict=True):
                if ref is not None and ref is not view:
                    view.copy_(ref)
                state[param]["exchange_ref"] = view

    def start(self, bucket: Bucket, step: int) -> None:
        """Send x_i(step) (or its bf16 update from r) to the group of ``step``; the sum arrives in
        ``bucket.buffer`` (or the update buffers' ``total``)."""
        group = self.link.topology.group_of(self.link.rank, step)
        bucket.pending_size = len(group)
        if len(group) == 1:
            return
        updates = self._updates.get(id(bucket))
        sent = bucket.buffer
        if updates is not None and not updates.whole:
            for param, ref, own in zip(bucket.params, updates.ref_views, updates.own_views, strict=True):
                torch.sub(param, ref, out=own)  # q_i = bf16(x_i - r): one rounding
            sent = updates.total
            sent.copy_(updates.own)
        else:
            torch._foreach_copy_(bucket.views, bucket.params)
        bucket.handle = self.link.start(sent, group, step, "parameter", counted=True)

    def finish(self, bucket: Bucket) -> None:
        """x_i <- sum_j W_ij(t) x_j(t): wait for the group sum and take its mean."""
        if bucket.pending_size <= 1:
            return
        self.settle(bucket)
        updates = self._updates.get(id(bucket))
        moves_ref = self._fixed_groups or bucket.pending_size == self.link.world_size
        if updates is not None and not updates.whole:  # x_i += S/m - q_i, r += S/m
            mean = bucket.buffer.copy_(updates.total).div_(bucket.pending_size)
            if moves_ref:
                updates.ref.add_(mean)
            mean.sub_(updates.own)
            torch._foreach_add_(bucket.params, bucket.views)
        else:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                torch.div(view, bucket.pending_size, out=param)  # one pass: scale while copying
            if updates is not None and moves_ref:  # a whole exchange (resumed without r): r is its mean
                torch._foreach_copy_(updates.ref_views, bucket.params)
                updates.whole = False
        bucket.pending_size = 0

    def settle(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Wait for the bucket's sum in flight; the next step mixes it in."""
        if bucket.handle is not None:
            self.link.wait(bucket.handle, "parameter", timeout)
            bucket.handle = None

    def abandon(self) -> None:
        """Nothing to forget: the parameters' sums are waited for at the next step, or never."""
