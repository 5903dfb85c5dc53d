"""The translation recipe with every rank's gradient replaced by the mean over all ranks.

A diagnostic, not a training mode: ``install()`` registers a global optimizer step pre-hook that,
before each :class:`~decentadam.DecentralizedAdam` step, all-reduces every parameter's gradient and
divides it by the world size. With ``optim.topology=complete``, ``optim.accum_steps=1`` and the
All-Reduce run's betas, every rank then takes AdamW's step on the mean gradient from the same
weights: the run is All-Reduce AdamW computed another way, which is what ``benchmarks.parity.oracle``
checks. Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.mean_gradients \\
        --preset multi30k-en-de --optimizer decentralized optim.topology=complete ...
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from benchmarks.parity.recipe import run_recipe
from decentadam import DecentralizedAdam

__all__ = ["install"]


def _average_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not isinstance(optimizer, DecentralizedAdam) or not dist.is_initialized():
        return
    world_size = dist.get_world_size()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)


def install() -> RemovableHandle:
    """Average every DecentralizedAdam's gradients over all ranks before each of its steps."""
    return register_optimizer_step_pre_hook(_average_gradients)


def main() -> None:
    install()
    run_recipe()


if __name__ == "__main__":
    main()
