"""The translation recipe with a filter on each rank's deviation from its group's mean, for free.

A probe, not a training mode. On the complete graph ``DecentralizedAdam`` sends
``x_i(t+1) = mix_i(t) - lr D_i(t)``, so a rank's deviation from the mean is ``lr`` times its
direction's deviation ``e_i(t) = D_i(t) - D_bar(t)``, and the next gradient, taken there, feeds it
back: along a direction of preconditioned curvature ``a = lr * lambda`` the deviation follows
``e(t) = (b1 - (1 - b1) a) e(t-1) + noise``, unstable from ``a = (1 + b1) / (1 - b1)`` (19 at
``b1 = 0.9``), half of what the mean's heavy-ball recurrence stands (38; docs/parity.md, section
5). A rank knows its last deviation when it steps: ``mix_i(t) - x_i(t) = lr(t-1) e_i(t-1)``.
This probe adds a second-order filter of the known deviations to every rank's step::

    k(t)   = (mix_i(t) - x_i(t)) / lr(t-1)          (0 on a step whose group is the rank alone)
    phi(t) = b1 phi(t-1) + c1 k(t) + c2 k(t-1)
    x_i(t+1) = mix_i(t) - lr(t) (D_i(t) + phi(t))   (weight decay as usual)

so the deviation follows ``e(t) = (b1 + c1 - (1 - b1) a) e(t-1) + c2 e(t-2) + noise``. With
``c1 > 0 > c2`` the recurrence is stable to a larger ``a`` (``(1 + b1 + c1 - c2) / (1 - b1)`` on the
complete graph while ``b1 + c1 + c2 < 1``), at the price of more deviation in the flattest
directions: ``python -m benchmarks.parity.stability`` has the rule. The ``k`` of a group that
averages sum to zero, so do the ``phi`` and the mean's step is the unfiltered one: no bytes, the
overlap unchanged, two parameter-sized buffers per rank held between steps (``phi`` and the last
``k``) and one allocated per step (the new ``k``). ``c1, c2`` come from ``DECENTADAM_FILTER``
(``"c1,c2"``, default ``0.4,-0.5``). Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.deviation_filter \\
        --preset multi30k-en-de --optimizer decentralized optim.intra_node=all_reduce \\
        optim.second_moment=group_gradient optim.topology=complete data=MULTI30K

or on simulated ranks, ``python -m benchmarks.parity.workers ... --optimizer-class
benchmarks.parity.deviation_filter.DeviationFilterAdam``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

import decentadam
from benchmarks.parity.recipe import run_recipe
from decentadam.buckets import Bucket
from decentadam.decentralized import LocalUpdate
from decentadam.optim.accum_adamw import step_group

__all__ = ["DeviationFilterAdam", "filter_coefficients"]


def filter_coefficients(text: str | None = None) -> tuple[float, float]:
    """``(c1, c2)`` from ``"c1,c2"`` (default: ``DECENTADAM_FILTER``, else ``0.4,-0.5``)."""
    text = text if text is not None else os.environ.get("DECENTADAM_FILTER", "0.4,-0.5")
    try:
        c1, c2 = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"DECENTADAM_FILTER must be two numbers 'c1,c2', got {text!r}") from None
    return c1, c2


class DeviationFilterAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose step adds ``phi``, a filter of the rank's known deviations."""

    def __init__(self, *args: Any, coefficients: tuple[float, float] | None = None, **kwargs: Any) -> None:
        self.c1, self.c2 = coefficients if coefficients is not None else filter_coefficients()
        self._known: dict[Tensor, Tensor] = {}  # k(t), per parameter, within a step
        self._previous: dict[Tensor, Tensor] = {}  # k(t-1)
        self._phi: dict[Tensor, Tensor] = {}
        self._last_lr: dict[int, float] = {}  # lr(t-1) per param group
        self._update: LocalUpdate = kwargs.get("local_update") or step_group  # then the filter
        kwargs["local_update"] = self._update_and_filter
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def _mix(self, bucket: Bucket) -> None:
        if bucket.pending_size <= 1:
            return  # the rank alone: nothing learnt of its deviation, k(t) = 0
        deviation = list(torch._foreach_neg(bucket.params))
        super()._mix(bucket)
        torch._foreach_add_(deviation, bucket.params)  # mix_i(t) - x_i(t)
        for param, known in zip(bucket.params, deviation, strict=True):
            self._known[param] = known

    @torch.no_grad()
    def _update_and_filter(
        self, state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]
    ) -> None:
        self._update(state, group, params)
        lr, beta1 = float(group["lr"]), float(group["betas"][0])
        last = self._last_lr.get(id(group))
        for param in params:
            known = self._known.pop(param, None)
            if known is not None and last:
                known.div_(last)  # k(t) = lr(t-1) e(t-1) / lr(t-1)
            else:
                known = None
            phi = self._phi.get(param)
            if phi is None:
                phi = self._phi[param] = torch.zeros_like(param)
            phi.mul_(beta1)
            if known is not None:
                phi.add_(known, alpha=self.c1)
            previous = self._previous.pop(param, None)
            if previous is not None:
                phi.add_(previous, alpha=self.c2)
            if known is not None:
                self._previous[param] = known
            param.sub_(phi, alpha=lr)
        self._last_lr[id(group)] = lr


def main() -> None:
    run_recipe(DeviationFilterAdam)


if __name__ == "__main__":
    main()
