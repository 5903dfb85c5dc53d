"""The ``[optim]`` section every recipe shares, and the optimizer it builds.

===================  ===========  ==================================================================
``optim.optimizer``  algorithm    built here
===================  ===========  ==================================================================
``allreduce``        ``adamw``    ``torch.optim.AdamW`` (betas_allreduce); the recipe wraps the model
                                  in DDP with ``accelerator.prepare``: every rank holds one model
``allreduce``        ``sgd``      ``torch.optim.SGD`` with momentum, under DDP the same way
``decentralized``    ``adamw``    ``decentadam.DecentralizedAdam`` (AccumAdamW, betas_decentralized)
                                  with the setting of ``optim.setting`` and the options after it
``a2cid2``           ``adamw``    ``decentadam.A2CiD2`` around a local ``AccumAdamW``
``a2cid2``           ``sgd``      ``decentadam.A2CiD2`` around a local SGD with momentum
===================  ===========  ==================================================================

DecentralizedAdam's options are those of :func:`decentadam.options.make_setting` under the same
names: its rules, its words (a refused combination is a :class:`ConfigError` with the library's
message). ``--optimizer allreduce`` ignores them (a preset serves both optimizers), but for those
that would change what is sent, which it refuses when set.

Parameter groups: weight decay on weight matrices and convolution kernels only, never on biases
and normalisation weights, i.e. on no tensor of fewer than two dimensions (BatchNorm and LayerNorm
weights and every bias are one-dimensional). AdamW and AccumAdamW decay decoupled, SGD as L2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from recipes.common.config import ConfigError

if TYPE_CHECKING:
    from decentadam import DecentralizedAdam
    from decentadam.collectives import Communicator
    from decentadam.options import Setting

__all__ = [
    "ALGORITHMS",
    "OPTIMIZERS",
    "OptimConfig",
    "build_optimizer",
    "decentralized_setting",
    "is_decentralized",
    "param_groups",
    "resolved",
]

OPTIMIZERS = ("allreduce", "decentralized", "a2cid2")
ALGORITHMS = ("adamw", "sgd")
Config = TypeVar("Config", bound="OptimConfig")
SENDS: Mapping[str, object] = MappingProxyType(
    {"exchange": "parameters", "intra_node": "gossip", "share_second_moment_every": 0, "sync_steps": 0}
)
"""Options that change what DecentralizedAdam sends, with their values that change nothing."""


@dataclass
class OptimConfig:
    optimizer: str = "decentralized"
    """``allreduce`` (AdamW or SGD under Accelerate's DDP: the baseline), ``decentralized``
    (DecentralizedAdam: each rank its own copy, averaged with neighbours in lockstep) or ``a2cid2``
    (asynchronous averagings with graph neighbours at random times; image recipe)."""
    algorithm: str = "adamw"
    """Local update: ``adamw`` (AccumAdamW when decentralized or a2cid2, torch AdamW under All-Reduce)
    or ``sgd`` (momentum SGD: All-Reduce or a2cid2)."""
    lr: float = 1e-3
    """Peak learning rate, reached after the warm-up."""
    betas_allreduce: tuple[float, float] = (0.9, 0.999)
    """Adam betas of AdamW under All-Reduce (the baseline)."""
    betas_decentralized: tuple[float, float] = (0.9, 0.999)
    """Adam betas of AccumAdamW, decentralized or under A2CiD2 (the paper's AccumAdam used (0.9, 0.999))."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay for Adam, L2 for SGD; never on biases and norms."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    label_smoothing: float = 0.1
    """Label smoothing of the training loss."""
    setting: str | None = None
    """DecentralizedAdam's setting, a name of ``decentadam.SETTINGS`` (docs/choosing.md); unset:
    ``default`` (``accumadam`` with ``accum_steps`` > 1). The options below change it; unset: the
    setting's."""
    topology: str | None = None
    """Graph of the parameter averaging: ``aer``, ``complete``, ``ring``, ``one-peer-exp``."""
    exchange: str | None = None
    """``parameters`` (float32 parameters) or ``bf16_updates`` (each rank's update from a shared
    reference point in bfloat16: half the bytes; a fixed group per rank or ``average_every``)."""
    average_every: int | None = None
    """Every that many steps the exchange is the exact average over all ranks (0: never)."""
    intra_node: str | None = None
    """``gossip`` (every rank a worker of the topology) or ``all_reduce`` (the ranks of a node
    average their gradients, as DDP does, and only nodes gossip: ``local_world_size`` ranks per node)."""
    second_moment: str | None = None
    """``all_ranks`` (that of the mean gradient over all ranks, estimated on each rank; also A2CiD2's
    local AccumAdamW), ``group_gradient`` (from the exchange group's gradients), ``global`` (the
    ranks' estimates averaged at the exact averages) or ``local`` (each rank's own: the paper's)."""
    v_every: int | None = None
    """``group_gradient`` under gossip: steps between two gradient exchanges (2)."""
    share_second_moment_every: int | None = None
    """``group_gradient`` with ``intra_node = "all_reduce"``: send the node's estimate with every k-th
    exchange, so the nodes use their mean (1 byte per parameter and step at k = 2; 0: not shared)."""
    sync_steps: int | None = None
    """The first this many steps wait for their exchange and mix at once, so every rank takes its
    next gradient at the mixed point (a synchronous warm-up); 0: every step overlaps."""
    accum_steps: int | None = None
    """AccumAdam window s (``second_moment = "local"``, also A2CiD2's): the moments advance once per
    s steps with the window's mean gradient; alone, > 1 selects the setting ``accumadam``."""
    local_world_size: int = 0
    """Ranks per node (0 = the launcher's LOCAL_WORLD_SIZE); 2 on one machine emulates nodes of 2."""
    graph: str = "ring"
    """A2CiD2: the graph whose neighbours average together: ``ring``, ``exp`` or ``complete``."""
    rate: float = 1.0
    """A2CiD2: averagings per gradient step of each rank, on average."""


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


def decentralized_setting(o: OptimConfig) -> Setting:
    """DecentralizedAdam's setting of ``o``; ConfigError with the library's message where refused."""
    from decentadam.options import setting_of

    try:
        return setting_of(o)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_optimizer(o: OptimConfig) -> None:
    """Raise ConfigError for an unknown optimizer or algorithm, and for an option the optimizer does
    not take (DecentralizedAdam is AccumAdamW; A2CiD2 takes a second moment of its own rank)."""
    if o.optimizer not in OPTIMIZERS or o.algorithm not in ALGORITHMS:
        raise ConfigError(
            f"optim.optimizer = {o.optimizer!r}, optim.algorithm = {o.algorithm!r}: expected an optimizer "
            f"of {', '.join(OPTIMIZERS)} and an algorithm of {', '.join(ALGORITHMS)}"
        )
    if o.optimizer == "decentralized":
        if o.algorithm != "adamw":
            raise ConfigError(
                f"optim.algorithm = {o.algorithm!r}: decentralized training runs DecentralizedAdam "
                "(AccumAdamW): use optim.algorithm=adamw, or --optimizer a2cid2 for gossip around SGD"
            )
        decentralized_setting(o)
        return
    for name, neutral in SENDS.items():
        value = getattr(o, name)
        if value not in (None, neutral):
            raise ConfigError(
                f"optim.{name} = {value!r} changes what DecentralizedAdam sends; --optimizer {o.optimizer} "
                f"does not take it: use --optimizer decentralized, or optim.{name}={neutral}"
            )
    if o.optimizer == "a2cid2":
        if o.setting is not None or o.second_moment not in (None, "all_ranks", "local"):
            given = (
                f"optim.setting = {o.setting!r}"
                if o.setting
                else f"optim.second_moment = {o.second_moment!r}"
            )
            raise ConfigError(
                f"{given}: A2CiD2's local AccumAdamW takes second_moment all_ranks (the default) or local, "
                "with no exchange of its own: use one of those with --optimizer a2cid2, or --optimizer "
                "decentralized"
            )
        if o.algorithm == "adamw" and o.accum_steps not in (None, 1) and o.second_moment != "local":
            raise ConfigError(
                f"optim.accum_steps = {o.accum_steps} needs optim.second_moment=local (each rank's own "
                "second moment, the paper's AccumAdam)"
            )


def resolved(o: Config) -> Config:
    """``o`` checked, DecentralizedAdam's options written out as its setting holds them (the
    effective configuration a run directory keeps, whatever the default setting becomes)."""
    check_optimizer(o)
    if o.optimizer != "decentralized":
        return o
    return dataclasses.replace(o, **decentralized_setting(o).flat())


def build_optimizer(
    model: nn.Module,
    o: OptimConfig,
    *,
    lr: float | None = None,
    world_size: int = 1,
    seed: int = 0,
    communicator: Communicator | None = None,
    timeout: float | None = None,
    optimizer_class: type[DecentralizedAdam] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of the table above for ``model`` (on its device already).

    ``lr`` replaces ``o.lr`` (a recipe's scaled rate). ``local_world_size`` 0 takes the launcher's
    ``LOCAL_WORLD_SIZE``; a value above ``world_size`` is capped to it (one node). ``communicator``
    replaces DecentralizedAdam's torch.distributed collectives (the time-to-quality benchmark times
    its step with exchanges that finish at once); ``timeout``: the seconds DecentralizedAdam waits for
    one exchange before raising (None: the process group's); ``optimizer_class`` builds the
    decentralized optimizer in place of DecentralizedAdam (a subclass: a benchmark's variant of it).
    A2CiD2's local AccumAdamW corrects its second moment as DecentralizedAdam's default does
    (``noise_ranks = world_size``) unless ``second_moment = "local"``. Raises ConfigError
    (:func:`check_optimizer`, and what DecentralizedAdam refuses for this job's size).
    """
    from decentadam import A2CiD2, AccumAdamW, DecentralizedAdam
    from decentadam.options import Comm

    check_optimizer(o)
    lr = o.lr if lr is None else lr
    groups = param_groups(model, o.weight_decay)
    if o.optimizer == "decentralized":  # decentadam: each rank keeps its own copy, averaged with neighbours
        local_world_size = min(o.local_world_size, world_size) if o.local_world_size else None
        comm = Comm(local_world_size=local_world_size, communicator=communicator, timeout=timeout)
        try:  # what the setting asks of this job's size is checked here (Setting.schedule)
            return (optimizer_class or DecentralizedAdam)(
                groups,
                lr,
                o.betas_decentralized,
                o.eps,
                o.weight_decay,
                setting=decentralized_setting(o),
                comm=comm,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
    local: torch.optim.Optimizer
    if o.algorithm == "sgd":
        local = torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.nesterov)
    elif o.optimizer == "a2cid2":
        own = o.second_moment == "local"
        local = AccumAdamW(
            groups,
            lr=lr,
            betas=o.betas_decentralized,
            eps=o.eps,
            accum_steps=o.accum_steps or 1,
            noise_ranks=1 if own else world_size,
        )
    else:
        local = torch.optim.AdamW(groups, lr=lr, betas=o.betas_allreduce, eps=o.eps)
    if o.optimizer == "a2cid2":  # decentadam: asynchronous gossip around the local step
        return A2CiD2(local, graph=o.graph, rate=o.rate, seed=seed)
    return local
