"""The translation recipe with the second moment of the mean gradient from the exchange group's gradients.

A probe of remedy c: the second moment All-Reduce divides by, ``E[mean_i(g_i)^2] = mu^2 +
sigma^2 / n``, estimated without the drift bias of a noise estimate taken over time. Every
``DECENTADAM_V_EVERY`` (k, default 2) steps a rank also sends its gradient, rounded to bfloat16,
to the group it exchanges parameters with (``numel * 2 / k`` bytes per step on top of the
parameters' ``numel * 4``: a quarter at k = 2), with the parameters, so it travels during the next
forward/backward like them. When the sum arrives (next step), with ``gbar`` the group's mean over
``q`` ranks and ``g_i`` the rank's own gradient of the same step::

    z = gbar^2 - (g_i^2 - gbar^2) * (1/q - 1/n) / (1 - 1/q)      # E[z] = mu^2 + sigma^2 / n
    A = beta2**k * A + (1 - beta2**k) * z                          # the same time constant as V
    v = max(A / (1 - beta2**(k u)), V_hat / n)                     # u: updates of A so far

(``E[gbar^2] = mu^2 + sigma^2 / q`` and ``E[g_i^2 - gbar^2] = sigma^2 (1 - 1/q)``; on a group of all
``n`` ranks ``z`` is All-Reduce's ``gbar^2`` itself.) Until the first group gradient arrives the
step is ``second_moment="all_ranks"``'s. The momentum stays the rank's own. With
``DECENTADAM_MIX_WEIGHT`` set, the mixing is also lazy (:mod:`benchmarks.parity.lazy_mixing`). Run it
like the recipe::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.group_gradient_v \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

import decentadam
from benchmarks.parity import moments
from decentadam.buckets import Bucket
from decentadam.collectives import Handle

__all__ = ["GroupGradientAdam", "group_gradient_update"]


@torch.no_grad()
def group_gradient_update(
    state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]
) -> None:
    """AdamW divided by the group-gradient estimate ``A`` (``all_ranks`` until ``A`` exists)."""
    beta1, beta2 = group["betas"]
    n = group.get("noise_ranks", 1)
    for p in params:
        st = state[p]
        t = moments.advance(st, p, group)
        if st.get("group_updates", 0) > 0:
            decay = beta2 ** (group["v_every"] * st["group_updates"])
            v = torch.maximum(st["group_sq"] / (1.0 - decay), st["exp_avg_sq"] / (1.0 - beta2**t) / n)
        else:
            v = moments.corrected_v(st, group, t)
        p.addcdiv_(st["exp_avg"], v.sqrt_().add_(group["eps"]), value=-group["lr"] / (1.0 - beta1**t))


class GroupGradientAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` with the group-gradient second moment (above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", group_gradient_update)
        self.v_every = int(os.environ.get("DECENTADAM_V_EVERY", "2"))
        # bucket id -> (handle, the sum arriving, the rank's own gradient, group size)
        self._gradient_exchanges: dict[int, tuple[Handle, Tensor, Tensor, int]] = {}
        super().__init__(*args, **kwargs)
        for group in self.param_groups:
            group["v_every"] = self.v_every

    def _step_bucket(self, bucket: Bucket) -> None:
        params = [p for p in bucket.params if p.grad is not None]
        exchange = self._gradient_exchanges.pop(id(bucket), None)
        group = self.param_groups[bucket.group_index]
        if exchange is not None:
            handle, total, own, size = exchange
            handle.wait(self.timeout)
            mean = total.div_(size)
            n = group["noise_ranks"]
            share = (1.0 / size - 1.0 / n) / (1.0 - 1.0 / size)
            z = mean.square() - (own.square() - mean.square()) * share
            decay = group["betas"][1] ** self.v_every
            offset = 0
            for p in bucket.params:
                st = self.state[p]
                if "exp_avg" not in st:
                    offset += p.numel()
                    continue
                if "group_sq" not in st:
                    st["group_sq"], st["group_updates"] = torch.zeros_like(p), 0
                st["group_sq"].mul_(decay).add_(z[offset : offset + p.numel()].view_as(p), alpha=1.0 - decay)
                st["group_updates"] += 1
                offset += p.numel()
        super()._step_bucket(bucket)  # mix, local step, send the parameters
        step = self._step + 1
        members = self.topology.group_of(self.rank, step)
        if len(members) > 1 and step % self.v_every == 0 and len(params) == len(bucket.params):
            own = torch.cat([p.grad.reshape(-1) for p in bucket.params if p.grad is not None])
            own = own.to(torch.bfloat16).float()  # what would be sent
            total = own.clone()
            handle = self.communicator.group_sum(total, members)
            self._gradient_exchanges[id(bucket)] = (handle, total, own, len(members))
            self.stats.bytes_sent += own.numel() * 2


def main() -> None:
    from recipes.common import cli
    from recipes.common.config import ConfigError
    from recipes.translation import data, train

    optimizer: type[decentadam.DecentralizedAdam] = GroupGradientAdam
    if "DECENTADAM_MIX_WEIGHT" in os.environ:  # with lazy mixing as well
        from benchmarks.parity.lazy_mixing import LazyMixingAdam

        class GroupGradientLazyAdam(GroupGradientAdam, LazyMixingAdam):
            pass

        optimizer = GroupGradientLazyAdam
    decentadam.DecentralizedAdam = optimizer  # type: ignore[misc]  # what build_optimizer builds
    cli.exit_on_bad_input(train.main, (ConfigError, data.DataError))


if __name__ == "__main__":
    main()
