"""The translation recipe with every rank's second moment taken from the all-reduced gradient.

An oracle, not a training mode: before each step the ranks all-reduce a copy of their gradients
(blocking, the parameter bytes per bucket and step), and each rank divides its own momentum by
All-Reduce's second moment, an EMA of the mean gradient's square with AdamW's bias correction. The
parameters still move as ``DecentralizedAdam`` moves them (the rank's own momentum, mixing on the
chosen topology, the exchange overlapped). Against ``group_gradient_v`` at k = 1 it separates what
that estimate lacks: the current step's mean gradient (this oracle) instead of the last one's; run
on ``aer`` and on ``complete`` it separates the graph. Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.v_oracle \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import decentadam
from benchmarks.parity import moments
from benchmarks.parity.recipe import run_recipe

__all__ = ["VOracleAdam", "v_oracle_update"]


@torch.no_grad()
def v_oracle_update(state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]) -> None:
    """AdamW with the rank's own momentum divided by the second moment of the all-reduced gradient."""
    beta1, beta2 = group["betas"]
    mean = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mean)
        mean.div_(dist.get_world_size())
    offset, t = 0, 0
    for p in params:
        st = state[p]
        t = moments.advance(st, p, group, "oracle_sq")
        size = p.numel()
        g = mean[offset : offset + size].view_as(p)
        st["oracle_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        v = (st["oracle_sq"] / (1.0 - beta2**t)).sqrt_().add_(group["eps"])
        p.addcdiv_(st["exp_avg"], v, value=-group["lr"] / (1.0 - beta1**t))
        offset += size


class VOracleAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose ``all_ranks`` step divides by All-Reduce's second moment (above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", v_oracle_update)
        super().__init__(*args, **kwargs)


def main() -> None:
    run_recipe(VOracleAdam)


if __name__ == "__main__":
    main()
