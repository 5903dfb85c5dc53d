"""The translation recipe with one second moment shared by all ranks: the mean of their corrected ones.

A probe of remedy c (a shared second moment) at its most exact, not a training mode: each rank
forms the ``all_ranks`` estimate of the second moment of the mean gradient from its own moments
(``v_i - (1 - 1/n) S_i``, see :class:`decentadam.AccumAdamW`), the ranks all-reduce it (one float32
all-reduce of the parameter bytes per bucket and step, blocking), and every rank divides its own
momentum by the same ``v``: ``max(mean_i(v_i - (1 - 1/n) S_i), mean_i(v_i) / n)``. What this run
gains over ``second_moment="all_ranks"`` bounds what a cheaper shared ``v`` (averaged with the
neighbours every few steps, piggybacked on the parameter exchange) can gain. Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.shared_v \\
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

__all__ = ["SharedVAdam", "shared_v_update"]


@torch.no_grad()
def shared_v_update(state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]) -> None:
    """AdamW with every rank's momentum divided by the ranks' mean corrected second moment."""
    beta1, beta2 = group["betas"]
    n = group.get("noise_ranks", 1)
    t = 0
    for p in params:
        t = moments.advance(state[p], p, group)
    own = torch.cat([state[p]["exp_avg_sq"].reshape(-1) for p in params]) / (1.0 - beta2**t)
    if t > 1 and n > 1:
        noise = torch.cat([state[p]["noise_sq"].reshape(-1) for p in params]) / (1.0 - beta2 ** (t - 1))
        both = torch.stack([own - (1.0 - 1.0 / n) * noise, own])
    else:
        both = torch.stack([own, own * n])
    if dist.is_initialized() and n > 1:
        dist.all_reduce(both)
        both.div_(dist.get_world_size())
    v = torch.maximum(both[0], both[1] / n).sqrt_().add_(group["eps"])
    offset, scale = 0, -group["lr"] / (1.0 - beta1**t)
    for p in params:
        size = p.numel()
        p.addcdiv_(state[p]["exp_avg"], v[offset : offset + size].view_as(p), value=scale)
        offset += size


class SharedVAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose ``all_ranks`` step divides by the shared second moment (above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", shared_v_update)
        super().__init__(*args, **kwargs)


def main() -> None:
    run_recipe(SharedVAdam)


if __name__ == "__main__":
    main()
