r"""Probe: quasi-global momentum (Lin et al., ICML 2021) on DecentralizedAdam's overlapped step.

Quasi-global momentum carries forward a rank's whole displacement, its own step and what the
mixing moved it, instead of the momentum of its own gradients: ``m = beta m_hat + g``, then
``m_hat = d``, ``d = (x(t) - x(t+1)) / lr`` (the paper's ``mu = 0``). On one rank the mixing moves
nothing and this is AdamW.

Adam's momentum is in gradient units and its update divides by ``sqrt(v)``; the mixing's share of
``d`` is in parameter units. Written in update units, the share that momentum carries into the
steps after is a second buffer ``Q``, with ``c(t)`` the displacement the mixing of step ``t`` gave
(``x`` before the mixing minus after, over the step's rate)::

    Q(t) = beta1 (Q(t-1) + c(t-1)),   x(t+1) = (1 - lr wd) W x(t) - lr (D(t) + Q(t))

which is the momentum form exactly where ``sqrt(v)`` and ``1 - beta1**t`` move slowly (after the
first steps). ``D`` is DecentralizedAdam's own update (its second moment as set). Bytes and
collectives are the wrapped setting's. Refuses ``Comm(overlap="backward")``, ``sync_steps`` (it
reads the mixing inside the step) and checkpoints (``Q`` is not in the state)::

    python -m benchmarks.parity.scale run --data MULTI30K --nodes 16 --method quasi-global \
        --seed 1 --steps 400 --out runs optim.lr=1e-3
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decentadam import DecentralizedAdam
from decentadam.buckets import Bucket


class QuasiGlobalAdam(DecentralizedAdam):
    """DecentralizedAdam whose momentum also carries what the mixing moved the rank (the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._backward is not None or self.setting.sync_steps:
            raise ValueError(
                "QuasiGlobalAdam reads the mixing inside the step: use overlap='step' and sync_steps=0"
            )
        with torch.no_grad():
            self._last = {id(b): [p.detach().clone() for p in b.params] for b in self._buckets}
            self._carried = {id(b): [torch.zeros_like(p) for p in b.params] for b in self._buckets}
            self._moved = {id(b): [torch.zeros_like(p) for p in b.params] for b in self._buckets}
        self._last_lr = [group["lr"] for group in self.param_groups]

    def _step_bucket(self, bucket: Bucket) -> None:
        last, carried, moved = self._last[id(bucket)], self._carried[id(bucket)], self._moved[id(bucket)]
        group = self.param_groups[bucket.group_index]
        beta1, lr = group["betas"][0], group["lr"]
        torch._foreach_add_(carried, moved)  # Q(t) = beta1 (Q(t-1) + c(t-1))
        torch._foreach_mul_(carried, beta1)
        for exchange in self._arriving:
            exchange.finish(bucket)  # W x(t)
        previous_lr = self._last_lr[bucket.group_index]
        torch._foreach_sub_(last, bucket.params)  # x(t) - W x(t)
        torch._foreach_mul_(last, 1.0 / previous_lr if previous_lr else 0.0)
        torch._foreach_copy_(moved, last)  # c(t), in update units
        self._local_update(self.state, group, [p for p in bucket.params if p.grad is not None], self._source)
        torch._foreach_add_(bucket.params, carried, alpha=-lr)
        for exchange in self._departing:
            exchange.start(bucket, self._step + 1)
        torch._foreach_copy_(last, bucket.params)  # x(t+1), before the next mixing

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = super().step(closure)
        self._last_lr = [group["lr"] for group in self.param_groups]  # the rate x(t+1) was made with
        return loss

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("QuasiGlobalAdam is a probe: its carried displacement is not saved")
