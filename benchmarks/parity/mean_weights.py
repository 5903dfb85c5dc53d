"""The translation recipe with every rank's parameters averaged over all ranks after each step.

A diagnostic, not a training mode. ``DecentralizedAdam`` mixes before its local step
(``x_i <- sum_j W_ij x_j - lr * D_i``), so rank ``i`` takes its next gradient at its own point,
which differs from the ranks' mean by ``lr * (D_i - mean_j D_j)`` on the complete graph: the noise
of its own direction. ``install()`` registers a global optimizer step post-hook that all-reduces
the parameters after each :class:`~decentadam.DecentralizedAdam` step and divides by the world
size, so every rank takes its next gradient at the mean, ``x_bar - lr * mean_j D_j``: with
``optim.topology=complete`` the run is "adapt, then combine" (each rank's Adam direction from its
own gradient and second moment, the directions averaged), which separates what the point where
gradients are taken costs from what the ranks' second moments cost. The exchange in flight carries
the unaveraged parameters, whose mean over the complete graph is the same average. Run it like
the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.mean_weights \\
        --preset multi30k-en-de --optimizer decentralized optim.topology=complete ...
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from benchmarks.parity.recipe import run_recipe
from decentadam import DecentralizedAdam

__all__ = ["install"]


@torch.no_grad()
def _average_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not isinstance(optimizer, DecentralizedAdam) or not dist.is_initialized():
        return
    world_size = dist.get_world_size()
    for group in optimizer.param_groups:
        for p in group["params"]:
            dist.all_reduce(p.data)
            p.data.div_(world_size)


def install() -> RemovableHandle:
    """Average every DecentralizedAdam's parameters over all ranks after each of its steps."""
    return register_optimizer_step_post_hook(_average_parameters)


def main() -> None:
    run_recipe(one_point=True)


if __name__ == "__main__":
    main()
