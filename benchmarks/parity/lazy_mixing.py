"""The translation recipe with lazy mixing: each rank moves only part of the way to its group's mean.

A probe, not a training mode. ``DecentralizedAdam`` mixes fully, ``x_i <- sum_j W_ij x_j``, so a
rank's deviation from the mean is its own last step's: along a curvature direction with
``a = lr * lambda`` (preconditioned) that deviation, driven by the rank's own momentum, is unstable
from ``a = 19.25`` while the mean (All-Reduce's heavy ball) is stable to ``38.25``
(``python -m benchmarks.parity.stability``). Adam at a peak learning rate trains at the edge of its
own stability, so the ranks' deviations can be the first thing to go unstable in the sharpest
directions. Lazy mixing, ``x_i <- (1 - alpha) x_i + alpha * sum_j W_ij x_j``, keeps part of the
deviation for the rank's momentum to cancel and moves the threshold to 28.75 (alpha = 0.5) or 33.5
(0.25), at the price of ranks further apart. No bytes, the overlap unchanged. Run it like the recipe
(``DECENTADAM_MIX_WEIGHT`` sets alpha, default 0.5)::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.lazy_mixing \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

import os
from typing import Any

import torch

import decentadam
from benchmarks.parity.recipe import run_recipe
from decentadam.buckets import Bucket

__all__ = ["LazyMixingAdam"]


class LazyMixingAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose mixing moves ``alpha`` of the way to the group's mean."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.mix_weight = float(os.environ.get("DECENTADAM_MIX_WEIGHT", "0.5"))
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def _mix(self, bucket: Bucket) -> None:
        if bucket.pending_size <= 1:
            return
        self._wait(bucket)
        for param, view in zip(bucket.params, bucket.views, strict=True):
            param.lerp_(view.div_(bucket.pending_size), self.mix_weight)
        bucket.pending_size = 0


def main() -> None:
    run_recipe(LazyMixingAdam)


if __name__ == "__main__":
    main()
