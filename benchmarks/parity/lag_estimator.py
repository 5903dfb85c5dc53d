"""The translation recipe with a second noise estimator for ``second_moment="all_ranks"``: the lag product.

A diagnostic, not a library option yet. ``DecentralizedAdam``'s ``all_ranks`` estimates a rank's
gradient noise from each gradient's deviation from the momentum before it. Where the mean gradient
itself oscillates from step to step (a sharp direction at a large learning rate), that deviation
is the oscillation, not noise: the estimate removes it from ``v``, the step there grows up to
``sqrt(n)``-fold, and the oscillation with it. The lag product keeps it: with gradients
``g_t = mu_t + e_t`` whose noise is independent from step to step, ``E[g_t g_(t-1)] = mu_t mu_(t-1)``,
whose size is the mean's square whether or not the mean changes sign::

    L = beta2 * L + (1 - beta2) * g_t * g_(t-1)                   # t > 1
    signal = min(|L| / (1 - beta2**(t-1)), v)                      # v: the bias-corrected V
    v = signal + (v - signal) / n                                  # the mean's square + noise / n

(``benchmarks.parity.remedies --estimator lag`` is the same rule on simulated ranks.) Run it like
the recipe; it trains with this update wherever the recipe builds a ``DecentralizedAdam`` with
``second_moment="all_ranks"``::

    accelerate launch --multi_gpu --num_processes 4 -m benchmarks.parity.lag_estimator \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import decentadam
from benchmarks.parity.recipe import run_recipe

__all__ = ["LagDecentralizedAdam", "lag_update"]


@torch.no_grad()
def lag_update(state: dict[Tensor, dict[str, Any]], group: dict[str, Any], params: list[Tensor]) -> None:
    """AdamW with ``v`` corrected for ``n = group["noise_ranks"]`` ranks by the lag estimator (above)."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    n = group.get("noise_ranks", 1)
    for p in params:
        grad = p.grad
        assert grad is not None
        st = state[p]
        if not st:
            st["step"] = torch.tensor(0.0, dtype=torch.float64)
            for key in ("exp_avg", "exp_avg_sq", "lag", "previous"):
                st[key] = torch.zeros_like(p)
        st["step"] += 1
        t = int(st["step"].item())
        if weight_decay:
            p.mul_(1.0 - lr * weight_decay)
        if t > 1:
            st["lag"].mul_(beta2).addcmul_(grad, st["previous"], value=1.0 - beta2)
        st["previous"].copy_(grad)
        st["exp_avg"].lerp_(grad, 1.0 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        v = st["exp_avg_sq"] / (1.0 - beta2**t)
        if t > 1 and n > 1:
            signal = torch.minimum(st["lag"].abs() / (1.0 - beta2 ** (t - 1)), v)
            v = signal + (v - signal) / n
        p.addcdiv_(st["exp_avg"], v.sqrt_().add_(eps), value=-lr / (1.0 - beta1**t))


class LagDecentralizedAdam(decentadam.DecentralizedAdam):
    """``DecentralizedAdam`` whose local step is :func:`lag_update` (for ``second_moment="all_ranks"``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("second_moment", "all_ranks") == "all_ranks":
            kwargs.setdefault("local_update", lag_update)
        super().__init__(*args, **kwargs)


def main() -> None:
    run_recipe(LagDecentralizedAdam)


if __name__ == "__main__":
    main()
