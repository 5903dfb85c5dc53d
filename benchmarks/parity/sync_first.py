"""The recipe with the first W steps' exchanges waited for at once (no overlap), then overlapped.

``DecentralizedAdam`` overlaps its exchange with the next forward/backward: a rank takes its next
gradient at its own point, ``x_bar - lr * (D_i - mean_j D_j)`` on the complete graph, and mixes
just before its next update. docs/parity.md (sections 10 and 13) puts about half of the nodes'
step-400 gap to All-Reduce on En-De there (``mean_weights``: every rank at the mean after each
step, an oracle). This probe asks how much of that a run keeps if only its first W steps
(``DECENTADAM_SYNC_STEPS``, default 300: the Multi30k presets' warm-up) wait for their exchange
right after the update and mix then, so the next gradient is taken at the mixed point, and every
later step overlaps as the library does. On the complete graph the first W steps are then
"adapt, then combine" (each node's Adam direction from its own moments, the directions averaged);
the exchange's bytes and arithmetic are the library's (``exchange="bf16_updates"`` included), only
its timing changes: W exchanges no longer hide behind compute. Run it like the recipe::

    DECENTADAM_SYNC_STEPS=300 accelerate launch --multi_gpu --num_processes 4 \\
        -m benchmarks.parity.sync_first --preset multi30k-en-fr --optimizer decentralized \\
        optim.intra_node=all_reduce optim.second_moment=group_gradient optim.topology=complete \\
        optim.exchange=bf16_updates data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import decentadam
from benchmarks.parity.recipe import period_from_env, run_recipe

__all__ = ["SyncFirstAdam", "steps_from_env"]


def steps_from_env() -> int:
    """``DECENTADAM_SYNC_STEPS``: how many first steps mix at once instead of overlapping (>= 1)."""
    return period_from_env("DECENTADAM_SYNC_STEPS", default=300)


class SyncFirstAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose first ``sync_steps`` steps wait for their exchange and mix at once."""

    def __init__(self, *args: Any, sync_steps: int | None = None, **kwargs: Any) -> None:
        self.sync_steps = sync_steps if sync_steps is not None else steps_from_env()
        super().__init__(*args, **kwargs)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = super().step(closure)
        if self.step_count <= self.sync_steps:
            with torch.no_grad():
                for bucket in self.buckets:
                    self._mix(bucket)  # waits; the next step's mix then has nothing pending
        return loss


def main() -> None:
    run_recipe(SyncFirstAdam)


if __name__ == "__main__":
    main()
