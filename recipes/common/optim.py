"""The optimizer of a recipe's run, and the one parameter-group rule every optimizer gets.

===================  ===========  ==================================================================
``optim.optimizer``  algorithm    built here
===================  ===========  ==================================================================
``allreduce``        ``adamw``    ``torch.optim.AdamW`` (betas_allreduce); the recipe wraps the model
                                  in DDP with ``accelerator.prepare``: every rank holds one model
``allreduce``        ``sgd``      ``torch.optim.SGD`` with momentum, under DDP the same way
``decentralized``    ``adamw``    ``decentadam.DecentralizedAdam`` (AccumAdamW, betas_decentralized,
                                  ``second_moment`` and its ``v_every``, window ``accum_steps``,
                                  ``topology``): each rank its own copy
``a2cid2``           ``adamw``    ``decentadam.A2CiD2`` around a local ``AccumAdamW``
``a2cid2``           ``sgd``      ``decentadam.A2CiD2`` around a local SGD with momentum
===================  ===========  ==================================================================

Parameter groups: weight decay on weight matrices and convolution kernels only, never on biases
and normalisation weights, i.e. on no tensor of fewer than two dimensions (BatchNorm and LayerNorm
weights and every bias are one-dimensional). AdamW and AccumAdamW decay decoupled, SGD as L2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recipes.common.config import ConfigError, check_choice

if TYPE_CHECKING:
    from decentadam import DecentralizedAdam
    from decentadam.collectives import Communicator

__all__ = [
    "ALGORITHMS",
    "EXCHANGES",
    "INTRA_NODE",
    "OPTIMIZERS",
    "SECOND_MOMENTS",
    "build_optimizer",
    "is_decentralized",
    "param_groups",
]

OPTIMIZERS = ("allreduce", "decentralized", "a2cid2")
ALGORITHMS = ("adamw", "sgd")
SECOND_MOMENTS = ("all_ranks", "local", "group_gradient")
INTRA_NODE = ("gossip", "all_reduce")
EXCHANGES = ("parameters", "bf16_updates")


def is_decentralized(optimizer: str) -> bool:
    """Whether each rank keeps its own model (no DDP wrapper; evaluate and save the consensus)."""
    return optimizer in ("decentralized", "a2cid2")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: ``weight_decay`` on tensors of two or more dimensions, none on the others."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    optimizer: str,
    *,
    algorithm: str = "adamw",
    lr: float,
    weight_decay: float,
    betas_allreduce: tuple[float, float],
    betas_decentralized: tuple[float, float],
    eps: float,
    momentum: float = 0.9,
    nesterov: bool = False,
    accum_steps: int = 1,
    second_moment: str = "all_ranks",
    v_every: int = 2,
    intra_node: str = "gossip",
    exchange: str = "parameters",
    share_second_moment_every: int = 0,
    sync_steps: int = 0,
    topology: str = "aer",
    local_world_size: int = 0,
    world_size: int = 1,
    graph: str = "ring",
    rate: float = 1.0,
    seed: int = 0,
    communicator: Communicator | None = None,
    timeout: float | None = None,
    optimizer_class: type[DecentralizedAdam] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of the table above for ``model`` (on its device already).

    ``local_world_size`` 0 takes the launcher's ``LOCAL_WORLD_SIZE``; a value above ``world_size`` is
    capped to it (one node). ``second_moment="all_ranks"`` gives the local AccumAdamW of A2CiD2 the same
    correction as DecentralizedAdam (``noise_ranks = world_size``); ``"group_gradient"``
    (DecentralizedAdam only) sends the gradient with the parameters every ``v_every`` steps, which is
    ignored with the other second moments and with ``intra_node="all_reduce"`` (the ranks of a node
    average their gradients; DecentralizedAdam only). ``exchange="bf16_updates"`` (DecentralizedAdam
    only) sends each rank's update in bfloat16 instead of its parameters. ``share_second_moment_every=k
    > 0`` (DecentralizedAdam with ``intra_node="all_reduce"`` and ``second_moment="group_gradient"``)
    sends the nodes' second moment with every k-th exchange. ``sync_steps=W`` (DecentralizedAdam only)
    makes the first W steps wait for their exchange and mix at once. Raises ConfigError for an
    unknown optimizer or algorithm, and for a decentralized run with ``sgd`` (DecentralizedAdam is
    AccumAdamW).
    ``communicator`` replaces DecentralizedAdam's torch.distributed collectives (the time-to-quality
    benchmark times its step with exchanges that finish at once). ``timeout``: the seconds
    DecentralizedAdam waits for one exchange before raising (None: the process group's).
    ``optimizer_class`` builds the decentralized optimizer in place of DecentralizedAdam (a subclass: a
    benchmark's variant of it).
    """
    from decentadam import A2CiD2, AccumAdamW, DecentralizedAdam

    if optimizer not in OPTIMIZERS or algorithm not in ALGORITHMS:
        raise ConfigError(
            f"optim.optimizer = {optimizer!r}, optim.algorithm = {algorithm!r}: expected an optimizer of "
            f"{', '.join(OPTIMIZERS)} and an algorithm of {', '.join(ALGORITHMS)}"
        )
    if optimizer == "decentralized" and algorithm != "adamw":
        raise ConfigError(
            f"optim.algorithm = {algorithm!r}: decentralized training runs DecentralizedAdam (AccumAdamW): "
            "use optim.algorithm=adamw, or --optimizer a2cid2 for gossip around SGD"
        )
    check_choice("optim.second_moment", second_moment, SECOND_MOMENTS)
    if second_moment != "local" and accum_steps > 1 and optimizer != "allreduce" and algorithm == "adamw":
        raise ConfigError(
            f"optim.accum_steps = {accum_steps} with optim.second_moment = {second_moment!r}: the corrected "
            "second moment replaces the accumulation window; set optim.accum_steps=1, or "
            "optim.second_moment=local for the paper's AccumAdam"
        )
    if not (isinstance(v_every, int) and v_every >= 1):
        raise ConfigError(f"optim.v_every = {v_every}: expected a positive integer (steps between gradients)")
    check_choice("optim.intra_node", intra_node, INTRA_NODE)
    check_choice("optim.exchange", exchange, EXCHANGES)
    if exchange != "parameters" and optimizer != "decentralized":
        raise ConfigError(
            f"optim.exchange = {exchange!r} is how DecentralizedAdam sends its parameters; --optimizer "
            f"{optimizer} does not take it: use --optimizer decentralized, or optim.exchange=parameters"
        )
    if not (isinstance(share_second_moment_every, int) and share_second_moment_every >= 0):
        raise ConfigError(
            f"optim.share_second_moment_every = {share_second_moment_every!r}: expected an integer >= 0 "
            "(steps between two exchanges of the nodes' second moment; 0: not shared)"
        )
    if share_second_moment_every and (
        optimizer != "decentralized" or intra_node != "all_reduce" or second_moment != "group_gradient"
    ):
        raise ConfigError(
            f"optim.share_second_moment_every = {share_second_moment_every} shares the nodes' second moment "
            f"of DecentralizedAdam(intra_node='all_reduce', second_moment='group_gradient'), but --optimizer "
            f"{optimizer}, optim.intra_node = {intra_node!r}, optim.second_moment = {second_moment!r}: use "
            "--optimizer decentralized optim.intra_node=all_reduce optim.second_moment=group_gradient, or "
            "optim.share_second_moment_every=0"
        )
    if not (isinstance(sync_steps, int) and sync_steps >= 0):
        raise ConfigError(
            f"optim.sync_steps = {sync_steps!r}: expected an integer >= 0 (how many first steps wait for "
            "their exchange; 0: every step overlaps)"
        )
    if sync_steps and optimizer != "decentralized":
        raise ConfigError(
            f"optim.sync_steps = {sync_steps} makes DecentralizedAdam's first steps wait for their "
            f"exchange; --optimizer {optimizer} does not take it: use --optimizer decentralized, or "
            "optim.sync_steps=0"
        )
    if intra_node == "all_reduce" and optimizer != "decentralized":
        raise ConfigError(
            f"optim.intra_node = 'all_reduce' averages gradients inside nodes before DecentralizedAdam's "
            f"step; --optimizer {optimizer} does not take it: use --optimizer decentralized, or "
            "optim.intra_node=gossip"
        )
    if second_moment == "group_gradient" and optimizer == "a2cid2":
        raise ConfigError(
            "optim.second_moment = 'group_gradient' sends the gradient with DecentralizedAdam's parameter "
            "exchange, which A2CiD2 does not have: use optim.second_moment=all_ranks (or local) with "
            "--optimizer a2cid2, or --optimizer decentralized"
        )
    groups = param_groups(model, weight_decay)
    if optimizer == "decentralized":  # decentadam: each rank keeps its own copy, averaged with neighbours
        return (optimizer_class or DecentralizedAdam)(
            groups, lr=lr, betas=betas_decentralized, eps=eps, weight_decay=weight_decay,
            accum_steps=accum_steps, second_moment=second_moment,  # type: ignore[arg-type]
            v_every=v_every if second_moment == "group_gradient" and intra_node == "gossip" else None,
            intra_node=intra_node, topology=topology, exchange=exchange,  # type: ignore[arg-type]
            share_second_moment_every=share_second_moment_every, sync_steps=sync_steps,
            local_world_size=min(local_world_size, world_size) if local_world_size else None,
            communicator=communicator, timeout=timeout,
        )  # fmt: skip
    local: torch.optim.Optimizer
    if algorithm == "sgd":
        local = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    elif optimizer == "a2cid2":
        noise_ranks = world_size if second_moment == "all_ranks" else 1
        local = AccumAdamW(
            groups,
            lr=lr,
            betas=betas_decentralized,
            eps=eps,
            accum_steps=accum_steps,
            noise_ranks=noise_ranks,
        )
    else:
        local = torch.optim.AdamW(groups, lr=lr, betas=betas_allreduce, eps=eps)
    if optimizer == "a2cid2":  # decentadam: asynchronous gossip around the local step
        return A2CiD2(local, graph=graph, rate=rate, seed=seed)
    return local
