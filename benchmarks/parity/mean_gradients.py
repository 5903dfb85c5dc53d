"""The translation recipe with every rank's gradient replaced by the mean over all ranks.

A diagnostic, not a training mode: :class:`MeanGradientAdam` all-reduces every parameter's
gradient and divides it by the world size before each step of :class:`~decentadam.DecentralizedAdam`.
On the complete graph with ``accum_steps=1``, each rank's own second moment and the All-Reduce
run's betas, every rank then takes AdamW's step on the mean gradient from the same weights: the
run is All-Reduce AdamW computed another way, which is what ``benchmarks.parity.oracle`` checks.
:func:`main` runs the recipe with this class in place of the one it builds by default::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.mean_gradients \\
        --preset multi30k-en-de --optimizer decentralized optim.topology=complete ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from decentadam import DecentralizedAdam

__all__ = ["MeanGradientAdam", "main"]


class MeanGradientAdam(DecentralizedAdam):
    """DecentralizedAdam whose every step first replaces each gradient by its mean over all ranks."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if dist.is_initialized():
            world_size = dist.get_world_size()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(world_size)
        return super().step(closure)


def main() -> None:
    """``recipes.translation.train`` with :class:`MeanGradientAdam`, bad input reported as the recipe does."""
    from recipes.common import cli
    from recipes.common.config import ConfigError
    from recipes.translation import data, train

    run = functools.partial(train.main, optimizer_class=MeanGradientAdam)
    cli.exit_on_bad_input(run, (ConfigError, data.DataError))


if __name__ == "__main__":
    main()
