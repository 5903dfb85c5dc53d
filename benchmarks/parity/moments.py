"""The moments of ``second_moment="all_ranks"`` written out per parameter, for the probes to share."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["advance", "corrected_v", "pull", "rank_noise"]


@torch.no_grad()
def advance(st: dict[str, Any], param: Tensor, group: dict[str, Any], *extra: str) -> int:
    """Decay ``param`` and advance its ``M``, ``V`` and ``S`` (``noise_sq``) as AccumAdamW(noise_ranks)
    does before its step; creates them (and the ``extra`` buffers) at the first step. Returns ``t``."""
    grad = param.grad
    assert grad is not None
    beta1, beta2 = group["betas"]
    if not st:
        st["step"] = torch.tensor(0.0, dtype=torch.float64)
        for key in ("exp_avg", "exp_avg_sq", "noise_sq", *extra):
            st[key] = torch.zeros_like(param)
    st["step"] += 1
    t = int(st["step"].item())
    if group["weight_decay"]:
        param.mul_(1.0 - group["lr"] * group["weight_decay"])
    if t > 1:
        st["noise_sq"].mul_(beta2).addcmul_(*2 * [rank_noise(st, grad, beta1, t)], value=1.0 - beta2)
    st["exp_avg"].lerp_(grad, 1.0 - beta1)
    st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    return t


def corrected_v(st: dict[str, Any], group: dict[str, Any], t: int) -> Tensor:
    """``second_moment="all_ranks"``'s ``v``: ``max(V_hat - (1 - 1/n) S_hat, V_hat / n)`` (``V_hat`` at
    the first step, or with ``n = 1``), a new tensor."""
    beta2 = group["betas"][1]
    n = group.get("noise_ranks", 1)
    own: Tensor = st["exp_avg_sq"] / (1.0 - beta2**t)
    if t > 1 and n > 1:
        return torch.maximum(own - (1.0 - 1.0 / n) * st["noise_sq"] / (1.0 - beta2 ** (t - 1)), own / n)
    return own


def rank_noise(st: dict[str, Any], grad: Tensor, beta1: float, t: int) -> Tensor:
    """``sqrt((1 + beta1) / 2) * (g_t - M_(t-1) / (1 - beta1**(t-1)))``: its square estimates the noise."""
    deviation = torch.sub(grad, st["exp_avg"], alpha=1.0 / (1.0 - beta1 ** (t - 1)))
    return deviation.mul_(((1.0 + beta1) / 2.0) ** 0.5)


def pull(st: dict[str, Any], direction: Tensor, group: dict[str, Any], t: int) -> Tensor:
    """``lr * (1 - 1/n) * (1 - rho) * direction``, the part of a rank's step it does not expect the
    others to share (``rho = mu^2 / (mu^2 + Var e)`` per coordinate from its own ``V`` and ``S``)."""
    beta1, beta2 = group["betas"]
    n = group.get("noise_ranks", 1)
    if t > 1 and n > 1:
        own = st["exp_avg_sq"] / (1.0 - beta2**t)
        noise = st["noise_sq"] / (1.0 - beta2 ** (t - 1))
        signal = (own - noise).clamp_(min=0.0)
        spread = noise * (1.0 - beta1) / (1.0 + beta1)
        not_shared = spread / (signal + spread + 1e-30)
    else:
        not_shared = torch.ones_like(direction)
    scale: float = group["lr"] * (1.0 - 1.0 / n)
    out: Tensor = direction * not_shared * scale
    return out
