"""The translation recipe with each node's ranks averaging their gradients before the local step.

Remedy f of the parity issue: inside a node (the fast link) the ranks all-reduce their gradients
before every step, as DDP would there (blocking, the parameter bytes per step on the fast link),
and only the nodes gossip. A node's ranks then take the same step from the node's mean gradient,
so the small-batch noise that each rank's step (and the point where it takes its next gradient)
carries is that of ``L`` ranks' tokens, not one's. The same all-reduce, of ``g`` and ``g**2``
together (twice the gradient bytes, on the fast link), gives the second moment of the mean over
all ``n`` ranks with no delay: with ``g_L`` the node's mean of ``g`` and ``s_L`` its mean of
``g**2 - g_L**2``, ``z = g_L**2 - s_L * (1/L - 1/n) / (1 - 1/L)`` has
``E[z] = mu^2 + sigma^2 / n`` (``E[s_L] = sigma^2 (1 - 1/L)``), the same on every rank of the
node, so that they stay replicas; ``v = max(A_hat, V_hat / (n / L))`` with ``A`` the EMA of
``z`` and ``V`` that of ``g_L**2``. The momentum is of ``g_L``. The parameters move as
``DecentralizedAdam`` moves them (mixing on the topology, the exchange overlapped). Run it like the
recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.node_gradient \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import decentadam
from benchmarks.parity import moments

__all__ = ["NodeGradientAdam", "node_gradient_update"]


@torch.no_grad()
def node_gradient_update(
    state: dict[Tensor, dict[str, Any]],
    group: dict[str, Any],
    params: list[Tensor],
    node: dist.ProcessGroup | None = None,
    node_size: int = 1,
    world_size: int = 1,
) -> None:
    """AdamW on the node's mean gradient, divided by the second moment estimated from it (above)."""
    beta1, beta2 = group["betas"]
    grads = [p for p in params if p.grad is not None]
    own = torch.cat([p.grad.reshape(-1) for p in grads])  # type: ignore[union-attr]
    both = torch.cat([own, own.square()])  # the node's mean of g and of g**2 in one all-reduce
    if node_size > 1:
        dist.all_reduce(both, group=node)
        both.div_(node_size)
    mean, mean_sq = both[: own.numel()], both[own.numel() :]
    nodes = world_size // node_size
    share = (1.0 / node_size - 1.0 / world_size) / (1.0 - 1.0 / node_size) if node_size > 1 else 0.0
    offset = 0
    for p in grads:
        size = p.numel()
        g, g_sq = mean[offset : offset + size].view_as(p), mean_sq[offset : offset + size].view_as(p)
        offset += size
        p.grad.copy_(g)  # type: ignore[union-attr]  # the momentum and V are of the node's mean
        st = state[p]
        t = moments.advance(st, p, group, "node_sq")
        z = g.square() - (g_sq - g.square()).mul_(share)
        st["node_sq"].mul_(beta2).add_(z, alpha=1.0 - beta2)
        v = st["node_sq"] / (1.0 - beta2**t)
        floor = st["exp_avg_sq"] / ((1.0 - beta2**t) * nodes)
        v = torch.maximum(v, floor).sqrt_().add_(group["eps"])
        p.addcdiv_(st["exp_avg"], v, value=-group["lr"] / (1.0 - beta1**t))


class NodeGradientAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose ranks average their gradients inside their node first (above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        node: dist.ProcessGroup | None = None
        node_size, world_size = 1, 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            world_size = dist.get_world_size()
            node_size = int(kwargs.get("local_world_size") or 1)
            if world_size % node_size:
                raise ValueError(f"node_gradient: {world_size} ranks are not nodes of {node_size}")
            for first in range(0, world_size, node_size):  # every rank makes every group, in order
                members = list(range(first, first + node_size))
                made = dist.new_group(members)
                if dist.get_rank() in members:
                    node = made

        def update(state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]) -> None:
            node_gradient_update(state, group, params, node, node_size, world_size)

        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", update)
        super().__init__(*args, **kwargs)


def main() -> None:
    from recipes.common import cli
    from recipes.common.config import ConfigError
    from recipes.translation import data, train

    decentadam.DecentralizedAdam = NodeGradientAdam  # type: ignore[misc]  # what build_optimizer builds
    cli.exit_on_bad_input(train.main, (ConfigError, data.DataError))


if __name__ == "__main__":
    main()
