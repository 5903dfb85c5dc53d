"""The recipe's nodes (``intra_node="all_reduce"``, ``group_gradient``) with All-Reduce's exact
second-moment sample every k steps.

With gradients averaged inside nodes, each node estimates All-Reduce's second moment from its own
ranks' gradients: ``z = g_L^2 - s_L (1/L - 1/n) / (1 - 1/L)``, unbiased for ``mu^2 + sigma^2 / n``
but built from one node's ``L`` gradients, so it is noisy and it moves with the node's own
momentum. Here, every ``k``-th step (``DECENTADAM_EXACT_V_EVERY``, default 2), the ranks all-reduce
their node's mean gradient rounded to bfloat16 and that step's fold into ``A`` uses the exact
``gbar^2`` in place of the node's ``z``; the other steps keep ``z``. On ``aer`` over 2 nodes the
exchange would travel with the inter-node parameters of every other step: 2 bytes per parameter
every 2 steps, a quarter of the parameter bytes per step. The probe all-reduces it, blocking (what
the measurement needs, not the overlap), and ``k = 1`` makes ``A`` All-Reduce's ``V`` (tested).
Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.node_exact_v \\
        --preset multi30k-en-de --optimizer decentralized optim.intra_node=all_reduce \\
        optim.second_moment=group_gradient data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import decentadam
from benchmarks.parity.recipe import period_from_env, run_recipe
from decentadam.optim.accum_adamw import step_group

__all__ = ["NodeExactVAdam", "exact_every", "exact_v_update"]


def exact_every() -> int:
    """``DECENTADAM_EXACT_V_EVERY``: the exact sample's period in steps (an integer >= 1)."""
    return period_from_env("DECENTADAM_EXACT_V_EVERY")


@torch.no_grad()
def exact_v_update(
    state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor], every: int = 2
) -> None:
    """Every k-th step, refold ``A`` with the all-rank mean gradient's square, then the library's step.

    ``A`` (``group_sq``) already holds this step's ``beta2 * A + (1 - beta2) * z`` when this runs;
    ``exact_prev``, kept at the end of the step before each exact one, is ``A`` as that step left
    it, so the exact sample replaces ``z`` exactly (one buffer per parameter, copied every k steps).
    """
    if not params:
        return
    first = state[params[0]]
    t = int(first["step"].item()) + 1 if "step" in first else 1
    beta2 = group["betas"][1]
    if t % every == 0 and dist.is_initialized() and dist.get_world_size() > 1:
        grads = [p.grad.reshape(-1) for p in params if p.grad is not None]  # all of them (the bucket's)
        mean = torch.cat(grads).to(torch.bfloat16).float()
        dist.all_reduce(mean)
        mean.div_(dist.get_world_size())  # each node's mean counted by its L ranks: the all-rank mean
        offset = 0
        for p in params:
            st = state[p]
            g = mean[offset : offset + p.numel()].view_as(p).to(p.dtype)
            previous = st.get("exact_prev")  # none only before the first step (k = 1)
            if previous is None:
                st["group_sq"].zero_()
            else:
                st["group_sq"].copy_(previous)
            st["group_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            offset += p.numel()
    step_group(state, group, params)
    if (t + 1) % every == 0:  # the next step is exact: keep A as this step leaves it
        for p in params:
            st = state[p]
            if "exact_prev" not in st:
                st["exact_prev"] = torch.empty_like(p)
            st["exact_prev"].copy_(st["group_sq"])


class NodeExactVAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose ``group_gradient`` steps fold in the exact sample every k steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        every = exact_every()  # read once; bad input fails before training starts
        if kwargs.get("second_moment") == "group_gradient":
            kwargs.setdefault("local_update", functools.partial(exact_v_update, every=every))
        kwargs.setdefault("share_second_moment_every", 0)  # A is this probe's, not the library's shared one
        super().__init__(*args, **kwargs)


def main() -> None:
    run_recipe(NodeExactVAdam)


if __name__ == "__main__":
    main()
