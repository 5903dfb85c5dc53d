"""The translation recipe with each rank's next gradient taken at a predicted point (a probe).

``DecentralizedAdam`` sends ``x_i = sum_j W_ij x_j - lr * D_i`` and takes its next gradient there,
at a point that holds all of its own step and none of the others': on the complete graph it lies
``lr * (D_i - mean_j D_j)`` from the mean, the noise of its own direction. This probe keeps what is
sent (so the ranks' mean moves exactly as before, and the exchange still overlaps the next
forward/backward), but moves the weights the model computes with to ``mixed - lr * E``, where ``E``
is what rank ``i`` can expect of the mean step from its own information::

    m_i = mu + e_i,   Var e_i = S (1 - beta1) / (1 + beta1),   mu^2 ~ max(v_own - S, 0)
    rho = mu^2 / (mu^2 + Var e_i)
    E   = D_i * (rho + (1 - rho) / n)

(the other ranks' momenta share ``mu``, shrunk by ``rho`` given ``m_i``, and not ``e_i``). Where
the mean gradient dominates (``rho`` near 1) the point is the rank's own, as before; where noise
dominates it is ``mixed`` plus ``1/n`` of the rank's step, near where the mean will be. The update
itself is ``second_moment="all_ranks"`` (the library's); the point costs no bytes and no memory
beyond a temporary. Run it like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.predicted_point \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400

The consensus evaluation averages the weights the ranks compute with (the predicted points), which
differ from the mean of what was sent by at most ``lr`` times a fraction of the mean step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import decentadam
from benchmarks.parity import moments
from benchmarks.parity.recipe import run_recipe
from decentadam.buckets import Bucket

__all__ = ["PredictedPointAdam", "predicted_update"]


@torch.no_grad()
def predicted_update(
    state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]
) -> None:
    """The ``all_ranks`` AccumAdamW step (accum_steps 1); leaves in ``state[p]["pull"]`` the part of
    the step that is the rank's own noise, ``lr * D * (1 - rho) * (1 - 1/n)``."""
    beta1 = group["betas"][0]
    for p in params:
        st = state[p]
        t = moments.advance(st, p, group)
        v = moments.corrected_v(st, group, t)
        direction = st["exp_avg"] / (1.0 - beta1**t) / v.sqrt_().add_(group["eps"])
        p.sub_(direction, alpha=group["lr"])
        st["pull"] = moments.pull(st, direction, group, t)


class PredictedPointAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` that sends its step and computes at the predicted point (above)."""

    point = True  # False: compute at the weights sent, as DecentralizedAdam does

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", predicted_update)
        super().__init__(*args, **kwargs)

    def _step_bucket(self, bucket: Bucket) -> None:
        params = [p for p in bucket.params if p.grad is not None and "pull" in self.state[p]]
        if self.point and bucket.pending_size <= 1:  # nothing overwrites the point: back to what was sent
            for p in params:
                p.sub_(self.state[p]["pull"])
        super()._step_bucket(bucket)  # mix, local step, send
        if self.point:
            for p in bucket.params:
                if p.grad is not None and "pull" in self.state[p]:
                    p.add_(self.state[p]["pull"])


def main() -> None:
    run_recipe(PredictedPointAdam)


if __name__ == "__main__":
    main()
