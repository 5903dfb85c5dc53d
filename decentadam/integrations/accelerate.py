"""Decentralized training in an Accelerate loop: ``prepare`` in place of ``accelerator.prepare``.

::

    accelerator = Accelerator(gradient_accumulation_steps=2)           # cpu=True on CPU-only machines
    model = build_model().to(accelerator.device)
    optimizer = DecentralizedAdam(model.parameters(), lr=7e-4)            # or setting="accumadam", ...
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    log_metrics_every(accelerator, optimizer, every=100)               # optional

    for batch in loader:                                               # the loop is unchanged
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)       # norm of this rank's gradient
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

What :func:`prepare` changes against ``accelerator.prepare``:

- models are placed on the device and get Accelerate's autocast (bf16/fp16), but are *not* wrapped
  in ``DistributedDataParallel``: no gradient is all-reduced. Each rank keeps its own model and
  gradient; the optimizer's parameter exchange is the only communication during training;
- an fp16 loss scaler becomes a :class:`~decentadam.amp.SyncedGradScaler`, so a step skipped for
  inf/NaN gradients on one rank is skipped on every rank;
- everything else (data loaders, optimizers, schedulers) goes through ``accelerator.prepare`` as
  usual. ``accelerator.accumulate`` then gives one exchange per optimizer step (none per
  micro-batch) and prepared schedulers step as under DDP.

Gradient norms (``accelerator.clip_grad_norm_``) are per rank: each rank clips its own gradient
(with ``overlap="step"``; under ``overlap="backward"`` clipping has no effect, see :func:`prepare`).
:func:`~decentadam.checkpoint.save_checkpoint` and ``load_checkpoint`` take the fp16 loss scaler
from the prepared optimizer, so a resumed fp16 run continues from the saved scale.
Save with :func:`decentadam.checkpoint.save_checkpoint`: ``accelerator.save_state`` writes only
rank 0's model and optimizer, which loses the other ranks' state.

:class:`decentadam.A2CiD2` (asynchronous gossip) goes through :func:`prepare` the same way, except
that the fp16 loss scaler stays Accelerate's: each rank skips its own overflowing steps.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from decentadam import distributed
from decentadam.amp import SyncedGradScaler
from decentadam.consensus import Decentralized, MetricsHook, register_metrics_hook, unwrap_optimizer
from decentadam.decentralized import DecentralizedAdam

__all__ = ["log_metrics_every", "prepare"]

logger = logging.getLogger(__name__)

_UNSUPPORTED = MappingProxyType(
    {
        DistributedType.DEEPSPEED: "DeepSpeed",
        DistributedType.FSDP: "FSDP",
        DistributedType.MEGATRON_LM: "Megatron-LM",
        DistributedType.XLA: "XLA",
    }
)


def prepare(accelerator: Accelerator, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)`` for decentralized training (see the module docstring).

    ``objects`` must include the :class:`DecentralizedAdam` or :class:`~decentadam.A2CiD2` that
    trains the models. Returns the prepared objects in the same order (one object alone is returned
    as is, like Accelerate).

    With :class:`~decentadam.A2CiD2` the fp16 loss scaler stays Accelerate's own: each rank skips
    its own overflowing steps, as nothing runs in lockstep (a synced scaler would add a collective
    per step, the wait asynchrony removes).

    A DecentralizedAdam with ``Comm(overlap="backward")`` updates each bucket of weights inside
    backward, as soon as its gradients are final. It is refused with gradient accumulation and with
    an fp16 loss scaler (``mixed_precision="fp16"``). ``accelerator.clip_grad_norm_`` cannot be
    refused, and has no effect in that mode: the weights are already updated when it runs. Use
    ``overlap="step"`` (the default) to clip gradients.
    """
    if accelerator.distributed_type in _UNSUPPORTED:
        raise ValueError(
            f"decentralized training keeps a full model on every rank; it cannot run under "
            f"{_UNSUPPORTED[accelerator.distributed_type]}. Launch with plain data parallelism "
            "(accelerate launch --multi_gpu, or --multi_gpu with ACCELERATE_USE_CPU=true on CPU)."
        )
    distributed.check_launch_environment()
    if device_placement is not None and len(device_placement) != len(objects):
        raise ValueError(
            f"device_placement has {len(device_placement)} entries for {len(objects)} objects; "
            "give one per object"
        )
    placements: list[bool | None] = list(device_placement) if device_placement else [None] * len(objects)
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    decentralized = [o for o in optimizers if _is_decentralized(o)]
    if not decentralized:
        raise TypeError(
            "decentadam's prepare() needs the DecentralizedAdam (or A2CiD2) among the objects: without "
            "it the models would train with no communication at all. Pass it, or use accelerator.prepare "
            "for DDP."
        )
    for optimizer in decentralized:
        _check_optimizer(accelerator, unwrap_optimizer(optimizer), objects, placements)

    synchronous = any(isinstance(unwrap_optimizer(o), DecentralizedAdam) for o in decentralized)
    if (
        synchronous
        and accelerator.scaler is not None
        and not isinstance(accelerator.scaler, SyncedGradScaler)
    ):
        accelerator.scaler = SyncedGradScaler.replacing(accelerator.scaler)

    prepared: list[Any] = list(objects)
    rest = [i for i, obj in enumerate(objects) if not isinstance(obj, nn.Module)]
    for i, obj in enumerate(objects):
        if isinstance(obj, nn.Module):
            # evaluation_mode: device placement and autocast, but no DistributedDataParallel wrapper.
            prepared[i] = accelerator.prepare_model(obj, device_placement=placements[i], evaluation_mode=True)
    if rest:
        outputs = accelerator.prepare(
            *[objects[i] for i in rest],
            device_placement=[placements[i] for i in rest] if device_placement is not None else None,
        )
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for i, output in zip(rest, outputs, strict=True):
            prepared[i] = output
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


def log_metrics_every(accelerator: Accelerator, optimizer: Any, every: int) -> MetricsHook:
    """Every ``every`` optimizer steps, ``accelerator.log`` the consensus distance and comm wait.

    Keys: ``decentadam/consensus_distance``, ``decentadam/consensus_distance_rel``,
    ``decentadam/comm_wait_ms`` (per step, mean over ranks), ``decentadam/comm_mb`` (per step and
    rank). They cost what :func:`decentadam.consensus.metrics` says (an all-reduce of a float64 copy
    of the parameters), every ``every`` steps and nothing between. ``.remove()`` on the result stops.
    """
    return register_metrics_hook(optimizer, every, lambda values, step: accelerator.log(values, step=step))


def _is_decentralized(optimizer: Any) -> bool:
    try:
        unwrap_optimizer(optimizer)
    except TypeError:
        return False
    return True


def _check_optimizer(
    accelerator: Accelerator,
    optimizer: Decentralized,
    objects: tuple[Any, ...],
    placements: list[bool | None],
) -> None:
    name = type(optimizer).__name__
    if optimizer.world_size != accelerator.num_processes:
        raise ValueError(
            f"the {name} spans {optimizer.world_size} ranks but Accelerate runs "
            f"{accelerator.num_processes} processes; build the Accelerator before the optimizer"
        )
    if isinstance(optimizer, DecentralizedAdam):
        _check_backward_overlap(accelerator, optimizer)
    devices = {_canonical(p.device) for group in optimizer.param_groups for p in group["params"]}
    model_moves = any(
        isinstance(o, nn.Module) and p is not False for o, p in zip(objects, placements, strict=True)
    )
    wanted = accelerator.device
    if model_moves and accelerator.device_placement and devices != {_canonical(wanted)}:
        raise ValueError(
            f"the {name} was built on parameters on {sorted(map(str, devices))}, but "
            f"Accelerate places the model on {wanted}: its communication buffers would stay behind. "
            "Move the model first, then build the optimizer: model.to(accelerator.device); "
            f"optimizer = {name}(...model.parameters()...)"
        )


def _check_backward_overlap(accelerator: Accelerator, optimizer: DecentralizedAdam) -> None:
    if optimizer.overlap == "backward" and accelerator.gradient_accumulation_steps > 1:
        raise ValueError(
            "Comm(overlap='backward') updates each bucket during backward, so it cannot "
            f"accumulate gradients over {accelerator.gradient_accumulation_steps} micro-batches; use "
            "overlap='step' with gradient_accumulation_steps > 1"
        )
    if optimizer.overlap == "backward" and accelerator.scaler is not None and accelerator.scaler.is_enabled():
        raise ValueError(
            "Comm(overlap='backward') updates the weights during backward with the loss-scaled "
            "gradients, before the fp16 loss scaler can unscale them or skip an overflowing step. Use "
            "overlap='step' with mixed_precision='fp16', or train in bf16."
        )


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` are the same place when 0 is the current device; CPU has no index."""
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "current_device"):
            return torch.device(device.type, backend.current_device())
    return device
