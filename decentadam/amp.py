"""A loss scaler whose skip decision is the same on every rank.

``torch.amp.GradScaler`` skips ``optimizer.step()`` when this rank's gradients hold inf/NaN. Under
DDP every rank sees the same (all-reduced) gradients, so they all agree. In decentralized training
each rank has its own gradients: one rank could skip while its neighbours step, and the parameter
exchange of the next step would pair different rounds (a hang, or silently wrong averages).
:class:`SyncedGradScaler` makes the found-inf flag the maximum over ranks, so either every rank
steps or every rank skips, and the loss scales stay equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["SyncedGradScaler"]


class SyncedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that agrees with every rank of ``process_group`` on skipping a step.

    Costs one all-reduce of a scalar per optimizer step (only when fp16 loss scaling is on).
    """

    def __init__(
        self, device: str = "cuda", *, process_group: dist.ProcessGroup | None = None, **kwargs: Any
    ):
        super().__init__(device, **kwargs)
        self.process_group = process_group

    @classmethod
    def replacing(
        cls, scaler: torch.amp.GradScaler, process_group: dist.ProcessGroup | None = None
    ) -> SyncedGradScaler:
        """A synced scaler with ``scaler``'s device, settings and current scale."""
        synced = cls(
            scaler._device,
            process_group=process_group,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler.is_enabled(),
        )
        state = scaler.state_dict()
        if state:
            synced.load_state_dict(state)
        return synced

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not (self.is_enabled() and dist.is_available() and dist.is_initialized()):
            return
        found = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if not found:
            return
        anywhere = torch.stack([f.reshape(()).to(found[0].device) for f in found]).amax()
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.process_group)
        for flag in found:
            flag.copy_(anywhere.to(flag.device).reshape(flag.shape))
