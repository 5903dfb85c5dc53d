"""Probe: All-Reduce's AdamW with every gradient one step old, to price a one-step delay alone.

Runs ``benchmarks.parity.workers --optimizer allreduce`` (same arguments) with the mean gradient of
step ``t`` applied at step ``t + 1`` (the first step moves nothing): what the held-update probe is
on the complete graph, with All-Reduce's own second moment instead of the ranks' estimates::

    python -m benchmarks.parity.delayed_adamw --preset multi30k-en-de --data MULTI30K --workers 16 \
        --optimizer allreduce --steps 200 --eval-every 100 --out runs/delayed.json
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.parity import workers
from recipes.common.optim import build_optimizer


class Delayed(torch.optim.Optimizer):
    """Mixed in before an optimizer's class: its step uses each parameter's gradient of the step before."""

    _held: dict[torch.Tensor, torch.Tensor | None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                now = None if p.grad is None else p.grad.detach().clone()
                p.grad, self._held[p] = self._held.get(p), now
        return super().step(closure)


def delayed(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer``, its gradients one step late (:class:`Delayed`)."""
    optimizer.__class__ = type(f"Delayed{type(optimizer).__name__}", (Delayed, type(optimizer)), {})
    optimizer._held = {}  # type: ignore[attr-defined]
    return optimizer


def main() -> None:
    def build_late(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
        return delayed(build_optimizer(model, cfg))

    setattr(workers, "build_optimizer", build_late)  # noqa: B010 (workers.train looks it up at call time)
    workers.main()


if __name__ == "__main__":
    main()
