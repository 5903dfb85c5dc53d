"""The translation recipe with a gossiped second moment and the predicted gradient point (a probe).

Two measurements located the mid-training gap of ``second_moment="all_ranks"`` on Multi30k
(docs/parity.md): every rank dividing by the same second moment gains about as much as taking
every rank's gradient at the mean of the ranks (the two together are All-Reduce on the complete
graph). This probe does both the way a library option could, with the exchange still overlapping
the next forward/backward:

- Shared second moment: each rank keeps ``C``, an EMA (``beta2``) of its gradient's square minus
  the share of its noise that averaging over ``n`` ranks removes
  (``g^2 - (1 - 1/n) (1 + beta1) / 2 (g - m_prev)^2``, the ``all_ranks`` estimate as one buffer),
  and every ``--v-every k`` steps averages ``C`` with the group it exchanges parameters with (sent
  rounded to bfloat16: ``numel * 2 / k`` bytes per step on top of the parameters' ``numel * 4``),
  so ``mean_i C_i`` is exactly the EMA of the ranks' mean estimate and each rank's ``C`` drifts
  towards it. ``v = max(C_hat, V_hat / n)`` with the rank's own ``V`` as the floor.
- Predicted point: the rank sends ``x_i = mixed - lr * D_i`` as before but computes its next
  gradient at ``mixed - lr * D_i * (rho + (1 - rho) / n)``, what it can expect of the ranks' mean
  step (``rho = mu^2 / (mu^2 + Var e_i)`` per coordinate from its own ``V`` and ``S``;
  :mod:`benchmarks.parity.predicted_point`).

Run it like the recipe (``DECENTADAM_V_EVERY`` sets k, default 2; ``DECENTADAM_POINT=0`` turns
the predicted point off)::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.gossip_v \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from benchmarks.parity import moments
from benchmarks.parity.predicted_point import PredictedPointAdam
from benchmarks.parity.recipe import run_recipe
from decentadam.buckets import Bucket
from decentadam.collectives import Handle

__all__ = ["GossipVAdam", "gossip_v_update"]


@torch.no_grad()
def gossip_v_update(state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]) -> None:
    """AdamW divided by the (gossiped) corrected second moment ``C``; leaves the point's pull."""
    beta1, beta2 = group["betas"]
    n = group.get("noise_ranks", 1)
    for p in params:
        st = state[p]
        grad = p.grad
        assert grad is not None
        increment = grad * grad
        if st and int(st["step"].item()) >= 1:  # the noise of this gradient, from the momentum before it
            noise = moments.rank_noise(st, grad, beta1, int(st["step"].item()) + 1)
            increment.addcmul_(noise, noise, value=-(1.0 - 1.0 / n))
        t = moments.advance(st, p, group, "shared_sq")
        st["shared_sq"].mul_(beta2).add_(increment, alpha=1.0 - beta2)
        v = torch.maximum(st["shared_sq"], st["exp_avg_sq"] / n) / (1.0 - beta2**t)
        direction = st["exp_avg"] / (1.0 - beta1**t) / v.sqrt_().add_(group["eps"])
        p.sub_(direction, alpha=group["lr"])
        st["pull"] = moments.pull(st, direction, group, t)


class GossipVAdam(PredictedPointAdam):
    """``DecentralizedAdam`` with the gossiped ``C`` and the predicted point (above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", gossip_v_update)
        self.v_every = int(os.environ.get("DECENTADAM_V_EVERY", "2"))
        self.point = os.environ.get("DECENTADAM_POINT", "1") != "0"
        self._v_exchanges: dict[int, tuple[Handle, Tensor, int]] = {}
        super().__init__(*args, **kwargs)

    def _shared(self, bucket: Bucket) -> list[Tensor]:
        return [self.state[p]["shared_sq"] for p in bucket.params if "shared_sq" in self.state[p]]

    def _step_bucket(self, bucket: Bucket) -> None:
        exchange = self._v_exchanges.pop(id(bucket), None)
        if exchange is not None:  # C_i <- mean of the group's C (sent at the end of the last step)
            handle, total, size = exchange
            handle.wait(self.timeout)
            offset = 0
            for shared in self._shared(bucket):
                shared.copy_(total[offset : offset + shared.numel()].view_as(shared)).div_(size)
                offset += shared.numel()
        super()._step_bucket(bucket)  # mix, local step, send the parameters, move to the point
        step = self._step + 1
        group = self.topology.group_of(self.rank, step)
        buffers = self._shared(bucket)
        if len(group) > 1 and step % self.v_every == 0 and buffers:
            total = torch.cat([c.reshape(-1) for c in buffers]).to(torch.bfloat16).float()  # sent as bf16
            self._v_exchanges[id(bucket)] = (self.communicator.group_sum(total, group), total, len(group))
            self.stats.bytes_sent += total.numel() * 2


def main() -> None:
    run_recipe(GossipVAdam)


if __name__ == "__main__":
    main()
