"""The recipe's nodes with the second moment's floor at ``V / N**2`` instead of ``V / N`` (``N``
nodes), alone or with the nodes' ``A`` shared (:mod:`benchmarks.parity.node_shared_a`).

With ``intra_node="all_reduce"`` and ``group_gradient`` a node divides its momentum by
``v = max(A_hat, V_hat / N)``: ``A`` estimates All-Reduce's second moment, ``V`` is the node's own
(of its mean gradient), and the floor keeps the step within ``sqrt(N)`` of the node's own Adam.
Where a gradient is sparse within a step, that is too little. Take an embedding row whose token
only rank ``a`` of node 1 saw this step, with gradient ``g`` there (``n`` ranks, ``L`` per node,
``n = L N``). All-Reduce steps ``(g / n) / sqrt((g / n)^2) = 1`` (in units of ``lr``); node 2 does
not step, so node 1 must step ``N`` for the nodes' mean to be All-Reduce's, which takes
``v = (g / n)^2``. Node 1 has ``V = (g / L)^2``, so the floor ``V / N`` is ``N`` times that, and its
own ``A`` (``z = g^2 / (L n)``) is too: it steps ``sqrt(N)`` and the mean ``1 / sqrt(N)``. A floor of
``V / N**2 = (g / n)^2`` lets it step ``N`` once ``A`` is ``(g / n)^2``, which is the nodes' mean of
their ``A`` (node 2's is 0): the lower floor alone changes nothing there (node 1's own ``A`` binds),
the shared ``A`` alone neither (the floor binds), both give All-Reduce's step. docs/parity.md,
section 14, has the runs.

This probe sets the floor's divisor to ``N**2`` for the library's update (``AccumAdamW``'s
``noise_ranks`` of the group, ``N`` there, for this step only; ``z`` does not use it), so the step
may grow to ``N`` times the node's own. With ``DECENTADAM_SHARED_A_EVERY=k`` the nodes' ``A`` is
also averaged every k steps as in ``node_shared_a`` (a quarter of the parameter bytes per step at
k = 2); without it, no bytes. Run it like the recipe::

    DECENTADAM_SHARED_A_EVERY=2 accelerate launch --multi_gpu --num_processes 4 \\
        -m benchmarks.parity.node_floor --preset multi30k-en-de --optimizer decentralized \\
        optim.intra_node=all_reduce optim.second_moment=group_gradient optim.topology=complete \\
        optim.exchange=bf16_updates data=MULTI30K train.max_steps=400

(``DECENTADAM_MEAN_WEIGHTS=1`` puts the ranks at one point, :func:`benchmarks.parity.recipe.run_recipe`.)
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

import decentadam
from benchmarks.parity.node_shared_a import shared_a_update, shared_every
from benchmarks.parity.recipe import run_recipe
from decentadam.decentralized import LocalUpdate
from decentadam.optim.accum_adamw import step_group

__all__ = ["NodeFloorAdam", "floor_update"]


@torch.no_grad()
def floor_update(
    state: dict[Tensor, dict[str, Any]],
    group: dict[str, Any],
    params: list[Tensor],
    *,
    inner: LocalUpdate = step_group,
) -> None:
    """``inner``'s step with the second moment's floor ``V / N**2`` (``N``: the group's
    ``noise_ranks``); the group's own ``noise_ranks`` is back in place afterwards."""
    saved = group["noise_ranks"]
    group["noise_ranks"] = saved * saved
    try:
        inner(state, group, params)
    finally:
        group["noise_ranks"] = saved


class NodeFloorAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose ``group_gradient`` floor is ``V / N**2``; with
    ``DECENTADAM_SHARED_A_EVERY`` set, the nodes' ``A`` averaged every k steps too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        shared = "DECENTADAM_SHARED_A_EVERY" in os.environ
        inner = functools.partial(shared_a_update, every=shared_every()) if shared else step_group
        if kwargs.get("second_moment") == "group_gradient":
            kwargs.setdefault("local_update", functools.partial(floor_update, inner=inner))
        kwargs.setdefault("share_second_moment_every", 0)  # the probe's floor and sharing, not the library's
        super().__init__(*args, **kwargs)


def main() -> None:
    run_recipe(NodeFloorAdam)


if __name__ == "__main__":
    main()
