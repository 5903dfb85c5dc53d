"""The translation recipe with each rank's next gradient taken nearer the ranks' mean, for free.

A probe, not a training mode. ``DecentralizedAdam`` sends ``x_i(t+1) = mix_i(t) - lr D_i(t)`` and
takes its next gradient there, ``lr (D_i - D_bar)`` away from the mean on the complete graph. With
one second moment for all ranks, ``D_i(t) - D_bar(t)`` is ``(1 - b1) (g_i - g_bar) / sqrt(v)``, the
fresh gradient's share, plus ``b1 (D_i(t-1) - D_bar(t-1))``, the rank's last deviation carried by
its momentum. The rank knows the second part when it steps: ``mix_i(t) - x_i(t)`` is
``lr (D_i(t-1) - D_bar(t-1))`` (where it was against where the group's mean went). This probe
sends the same ``x_i(t+1)`` but computes the next forward and backward at
``x_i(t+1) + c b1 lr(t) / lr(t-1) (mix_i(t) - x_i(t))`` (``c`` from ``DECENTADAM_POINT_SHIFT``,
default 1), and takes the shift back off before the next step. Over the ranks of one group the
shifts sum to zero, so the mean of the points is the mean of the parameters, not a step late (the
predicted point of ``predicted_point`` was); what is left of a rank's deviation at its gradient
is its fresh gradient's share: at ``c = 1`` about 0.44x its size (``0.1`` against
``0.1 / sqrt(1 - 0.81)`` of the gradient noise at ``b1 = 0.9``). The price, by the linear account of
``benchmarks.parity.stability``: along a direction of preconditioned curvature ``a = lr * lambda``
the deviation becomes ``-(1 - b1) a`` times the last one, unstable from ``a = 10`` instead of 19.
No bytes, the overlap unchanged. Between steps the model holds the shifted weights, so checkpoints
hold them too (not for resuming), and the evaluation's exact average over the ranks is the
parameters' own only on the complete graph, where the shifts sum to zero. Measured (docs/parity.md,
section 7): over 2 nodes on the complete graph the points were 3-6x closer in squared distance and
the run 0.22 nats behind the unshifted one at step 400. Run it like the recipe, on the complete
graph (over the nodes with ``optim.intra_node=all_reduce``), where the group's mean is the mean::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.point_shift \\
        --preset multi30k-en-de --optimizer decentralized optim.topology=complete data=MULTI30K
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

import decentadam
from benchmarks.parity.recipe import run_recipe
from decentadam.buckets import Bucket

__all__ = ["PointShiftAdam"]


class PointShiftAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose forward and backward run at its parameters shifted towards the mean."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.shift_scale = float(os.environ.get("DECENTADAM_POINT_SHIFT", "1.0"))
        self._shifts: dict[int, list[Tensor]] = {}  # on the parameters between steps
        self._deviations: dict[int, list[Tensor]] = {}  # mix_i(t) - x_i(t), within a step
        self._last_lr: dict[int, float] = {}
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def _mix(self, bucket: Bucket) -> None:
        shifts = self._shifts.pop(id(bucket), None)
        if shifts is not None:
            torch._foreach_sub_(bucket.params, shifts)  # back to x_i(t), what the exchange carried
        if bucket.pending_size <= 1:
            return
        deviation = list(torch._foreach_neg(bucket.params))
        super()._mix(bucket)
        torch._foreach_add_(deviation, bucket.params)
        self._deviations[id(bucket)] = deviation

    @torch.no_grad()
    def _step_bucket(self, bucket: Bucket) -> None:
        super()._step_bucket(bucket)  # mixes, steps and sends x_i(t+1) unshifted
        deviation = self._deviations.pop(id(bucket), None)
        group = self.param_groups[bucket.group_index]
        lr, last = float(group["lr"]), self._last_lr.get(id(bucket))
        self._last_lr[id(bucket)] = lr
        if deviation is not None and last:
            torch._foreach_mul_(deviation, self.shift_scale * group["betas"][0] * lr / last)
            torch._foreach_add_(bucket.params, deviation)
            self._shifts[id(bucket)] = deviation


def main() -> None:
    run_recipe(PointShiftAdam)


if __name__ == "__main__":
    main()
