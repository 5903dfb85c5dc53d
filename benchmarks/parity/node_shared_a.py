"""The recipe's nodes (``intra_node="all_reduce"``, ``group_gradient``) with one second-moment
history for all nodes: every k steps each node's ``A`` is replaced by the mean of the nodes' ``A``.

Each node estimates All-Reduce's second moment from its own ranks' gradients,
``z = g_L^2 - s_L (1/L - 1/n) / (1 - 1/L)``. Two things separate that from All-Reduce's ``V``:
the estimate is noisy (one node's ``L`` gradients per step), and a node's ``A`` holds its own
batches' large gradients (a token seen only by this node raises this node's ``A``, and only its
momentum), so where gradients are sparse the mean of the nodes' steps is shorter than
All-Reduce's. The exact ``V`` (``v_oracle``, ``node_exact_v``) removes both but also what a
node's own estimate holds of its deviation from the mean (``(H e)^2``: the same on both ranks of
a node, it cancels in the all-rank mean gradient, not in a mean of squares), and did not help
(docs/parity.md section 10). The mean of the nodes' ``A`` keeps that term, since each ``A`` is
already a mean of squares.

Here, after every k-th step (``DECENTADAM_SHARED_A_EVERY``, default 2) the ranks all-reduce ``A``
rounded to bfloat16 and divide by the world size (the ranks of a node hold the same ``A``, so this
is the mean over the nodes); the next steps fold their own ``z`` into that shared history as the
library does. That is what a node would have if ``A`` travelled with the inter-node parameter
exchange of every k-th step (which completes before the next step's update): 2 bytes per
parameter every k steps, a quarter of the float32 parameter bytes per step at k = 2. The probe
all-reduces it, blocking (the measurement, not the overlap). Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.node_shared_a \\
        --preset multi30k-en-de --optimizer decentralized optim.intra_node=all_reduce \\
        optim.second_moment=group_gradient optim.topology=complete optim.exchange=bf16_updates \\
        data=MULTI30K train.max_steps=400
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

__all__ = ["NodeSharedAAdam", "average_group_sq", "shared_a_update", "shared_every"]


def shared_every() -> int:
    """``DECENTADAM_SHARED_A_EVERY``: how often, in steps, the nodes' ``A`` are averaged (>= 1)."""
    return period_from_env("DECENTADAM_SHARED_A_EVERY")


@torch.no_grad()
def average_group_sq(state: dict[Tensor, dict[str, Any]], params: list[Tensor]) -> None:
    """Replace every parameter's ``A`` by the all-rank mean of its bfloat16-rounded value."""
    held = [p for p in params if "group_sq" in state[p]]
    if not held:
        return
    flat = torch.cat([state[p]["group_sq"].reshape(-1) for p in held]).to(torch.bfloat16).float()
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for p in held:
        a = state[p]["group_sq"]
        a.copy_(flat[offset : offset + a.numel()].view_as(a))
        offset += a.numel()


@torch.no_grad()
def shared_a_update(
    state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor], every: int = 2
) -> None:
    """The library's step (its ``A`` holds this step's own ``z``), then, every k-th step, ``A``
    averaged over the nodes for the steps after it."""
    if not params:
        return
    step_group(state, group, params)
    t = int(state[params[0]]["step"].item())
    if t % every == 0 and dist.is_initialized() and dist.get_world_size() > 1:
        average_group_sq(state, params)


class NodeSharedAAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose ``group_gradient`` estimate is averaged over the nodes every k steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        every = shared_every()  # read once; bad input fails before training starts
        if kwargs.get("second_moment") == "group_gradient":
            kwargs.setdefault("local_update", functools.partial(shared_a_update, every=every))
        kwargs.setdefault("share_second_moment_every", 0)  # the probe shares A itself, blocking
        super().__init__(*args, **kwargs)


def main() -> None:
    run_recipe(NodeSharedAAdam)


if __name__ == "__main__":
    main()
