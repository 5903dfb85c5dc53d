"""What :class:`~decentadam.DecentralizedAdam` does (a :class:`Setting`) and how it talks (:class:`Comm`).

A setting is chosen by name from :data:`SETTINGS` (``docs/choosing.md`` says when to use each, with
their measurements), or written as a :class:`Setting`; every rule about which options go together
is checked here, once, when the value is built::

    DecentralizedAdam(params, lr=1e-3)                             # SETTINGS["default"]
    DecentralizedAdam(params, lr=1e-3, setting="accumadam")        # the paper's AccumAdam, window 4
    DecentralizedAdam(params, lr=1e-3, accum_steps=8)              # the same with a window of 8
    DecentralizedAdam(params, lr=1e-3, setting=Setting(topology="aer", second_moment=Local()))
    DecentralizedAdam(params, lr=1e-3, setting="nodes-complete-bf16", comm=Comm(timeout=60))

Configuration files hold the same options flat (``second_moment = "group_gradient"``, ``v_every =
2``): :func:`make_setting` maps them onto a :class:`Setting`, for the recipes, the Trainer and the
fairseq2 adapter alike. What depends on the job's size (a topology that ``bf16_updates`` cannot
follow, a node of one rank) is checked by :meth:`Setting.schedule` when the optimizer is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, TypeAlias

import torch
from torch import Tensor

from decentadam.collectives import Communicator
from decentadam.optim.accum_adamw import MomentSource, is_count
from decentadam.topology import (
    TOPOLOGIES,
    Topology,
    changing_groups,
    communicates,
    has_global_round,
    over_nodes,
    resolve,
    with_global_average,
)

__all__ = [
    "DEFAULT_SETTING",
    "EXCHANGES",
    "FLAT_OPTIONS",
    "INTRA_NODE",
    "SECOND_MOMENTS",
    "SETTINGS",
    "AllRanks",
    "Comm",
    "Global",
    "GroupGradient",
    "Local",
    "LocalUpdate",
    "SecondMoment",
    "Setting",
    "make_setting",
    "setting_of",
]

Exchange = Literal["parameters", "bf16_updates"]
EXCHANGES: tuple[Exchange, ...] = ("parameters", "bf16_updates")
IntraNode = Literal["gossip", "all_reduce"]
INTRA_NODE: tuple[IntraNode, ...] = ("gossip", "all_reduce")
Overlap = Literal["step", "backward"]
LocalUpdate = Callable[[dict[Tensor, dict[str, Any]], dict[str, Any], list[Tensor], MomentSource], None]
"""``fn(state, group, params, source)``: update ``params`` (those of one bucket with a gradient) in
place; ``source`` says which second moment the AccumAdamW update divides by."""


# ---------------------------------------------------------------------------- the second moment


@dataclass(frozen=True)
class Local:
    """Each rank's own second moment: DAdam, and with ``accum_steps > 1`` the AccumAdam of Wang et
    al. (the moments advance once per window of ``accum_steps`` steps, :class:`~decentadam.AccumAdamW`)."""

    accum_steps: int = 1
    name: ClassVar[str] = "local"

    def __post_init__(self) -> None:
        if not is_count(self.accum_steps, 1):
            raise ValueError(f"accum_steps must be an integer >= 1, got {self.accum_steps!r}")


@dataclass(frozen=True)
class AllRanks:
    """The second moment of the mean gradient over all ranks, estimated on each rank from its own
    gradients' noise (no bytes; ``n`` the number of ranks, or of nodes with ``intra_node="all_reduce"``)."""

    name: ClassVar[str] = "all_ranks"


@dataclass(frozen=True)
class GroupGradient:
    """The second moment of the mean gradient from the gradients of a rank's exchange group: sent with
    the parameters every ``v_every`` steps (default 2) under gossip; from the node's all-reduced
    gradients at every step, with no bytes of their own, under ``intra_node="all_reduce"`` (leave
    ``v_every`` out there). ``share_second_moment_every=k`` (nodes only; 0: off) sends the node's
    estimate with every k-th exchange so the nodes use their mean (:mod:`decentadam.exchanges.moments`)."""

    v_every: int | None = None
    share_second_moment_every: int = 0
    name: ClassVar[str] = "group_gradient"

    def __post_init__(self) -> None:
        if self.v_every is not None and not is_count(self.v_every, 1):
            raise ValueError(
                f"v_every must be an integer >= 1 (send the gradient every v_every steps), got "
                f"{self.v_every!r}: use 1 for every step, 2 (the default) for every other step"
            )
        if not is_count(self.share_second_moment_every, 0):
            raise ValueError(
                f"share_second_moment_every must be an integer >= 0 (send the node's second moment every "
                f"that many steps; 0: never), got {self.share_second_moment_every!r}: use 2 (1 byte per "
                "parameter and step), or 0 (the default)"
            )


@dataclass(frozen=True)
class Global:
    """The ranks' :class:`AllRanks` estimates averaged at the exact averages over all ranks (needs
    ``average_every`` or the complete topology), the floor lowered to ``V / n**2``. ``floored``:
    each rank floors its estimate at ``V / n`` before the average (False: the raw estimates, which
    average without that bias, are averaged and only the mean is floored, at ``V / n**2``)."""

    floored: bool = True
    name: ClassVar[str] = "global"


SecondMoment: TypeAlias = Local | AllRanks | GroupGradient | Global
SECOND_MOMENTS: Mapping[str, type[SecondMoment]] = MappingProxyType(
    {kind.name: kind for kind in (AllRanks, Local, GroupGradient, Global)}
)
"""The second moments by the name that configuration files and saved states use."""


def _second_moment_named(name: object) -> SecondMoment:
    kind = SECOND_MOMENTS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(
            f"second_moment must be one of {', '.join(map(repr, SECOND_MOMENTS))} (or AllRanks(), "
            f"Local(accum_steps), GroupGradient(...), Global()), got {name!r}"
        )
    return kind()


# ---------------------------------------------------------------------------- the setting


@dataclass(frozen=True)
class Setting:
    """The algorithm of a decentralized run: whom each rank averages with, what it sends, and which
    second moment its AccumAdamW step divides by. Checked when built; :data:`SETTINGS` names the
    ones the measurements keep.

    The fields' defaults are the default setting (``DecentralizedAdam(params, lr)``): the ranks of a
    node average their gradients, the nodes gossip on the one-peer exponential graph with bfloat16
    updates, every 32nd step is an exact average over all ranks that also averages the ranks'
    second-moment estimates, and every step overlaps its exchange (on one node, whose ranks are
    replicas, it is DDP). On 8-32 simulated nodes it was the closest to All-Reduce of the settings
    that keep the overlap and send about 0.6x (0.56-0.61x) the bytes of a bfloat16 all-reduce
    (``docs/results/2026-11-29-default.md``). A field given replaces
    only itself: ``Setting(second_moment=Local())`` is the default with each rank's own second moment.
    """

    topology: str | Topology = "one-peer-exp"
    """The graph schedule of the exchanges (:mod:`decentadam.topology`): a name, or a built Topology."""
    exchange: Exchange = "bf16_updates"
    """``"parameters"`` (each rank's float32 parameters) or ``"bf16_updates"`` (each rank's update
    from a reference point every member holds, in bfloat16: half the bytes;
    :mod:`decentadam.exchanges.parameters`)."""
    average_every: int = 32
    """Every that many steps the exchange is the exact average over all ranks (0: never)."""
    intra_node: IntraNode = "all_reduce"
    """``"gossip"`` (every rank a worker of the topology) or ``"all_reduce"`` (the ranks of a node
    average their gradients first, as DDP does, and only nodes gossip;
    :mod:`decentadam.exchanges.node_gradients`)."""
    second_moment: SecondMoment = Global()
    """:class:`Local`, :class:`AllRanks`, :class:`GroupGradient` or :class:`Global` (a name is taken
    as that kind with its defaults)."""
    sync_steps: int = 0
    """The first this many steps wait for their exchange and mix at once, so every rank takes its
    next gradient at the mixed point (a synchronous warm-up; later steps overlap)."""

    def __post_init__(self) -> None:
        if isinstance(self.second_moment, str):
            object.__setattr__(self, "second_moment", _second_moment_named(self.second_moment))
        if not isinstance(self.second_moment, SecondMoment):
            _second_moment_named(self.second_moment)  # raises, naming the kinds
        topology = self.topology
        if not isinstance(topology, Topology) and topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}; choose one of {sorted(TOPOLOGIES)}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be 'parameters' or 'bf16_updates', got {self.exchange!r}")
        if not is_count(self.average_every, 0):
            raise ValueError(
                f"average_every must be an integer >= 0 (every that many steps the exchange is the exact "
                f"average over all ranks; 0: never), got {self.average_every!r}"
            )
        if self.intra_node not in INTRA_NODE:
            raise ValueError(f"intra_node must be 'gossip' or 'all_reduce', got {self.intra_node!r}")
        if not is_count(self.sync_steps, 0):
            raise ValueError(
                f"sync_steps must be an integer >= 0 (how many first steps wait for their exchange), "
                f"got {self.sync_steps!r}: use the learning rate's warm-up steps, or 0 (the default)"
            )
        moment, nodes = self.second_moment, self.intra_node == "all_reduce"
        if isinstance(moment, GroupGradient) and nodes and moment.v_every not in (None, 1):
            raise ValueError(
                f"v_every={moment.v_every!r}: with intra_node='all_reduce' the node's gradients give "
                "second_moment='group_gradient' its estimate at every step, with no bytes of its own; "
                "leave v_every out"
            )
        if isinstance(moment, GroupGradient) and moment.share_second_moment_every and not nodes:
            raise ValueError(
                f"share_second_moment_every={moment.share_second_moment_every} shares the nodes' "
                f"second_moment='group_gradient' estimate, but intra_node={self.intra_node!r}: pass "
                "intra_node='all_reduce' with it, or leave it out"
            )

    # ------------------------------------------------------------------ derived values

    @property
    def accum_steps(self) -> int:
        """The AccumAdamW window of the param groups' defaults (1 but for :class:`Local`)."""
        return self.second_moment.accum_steps if isinstance(self.second_moment, Local) else 1

    @property
    def v_every(self) -> int | None:
        """k of :class:`GroupGradient` (1 with the nodes' gradients, 2 by default), else None."""
        moment = self.second_moment
        if not isinstance(moment, GroupGradient):
            return None
        if moment.v_every is not None:
            return moment.v_every
        return 1 if self.intra_node == "all_reduce" else 2

    @property
    def share_every(self) -> int:
        """k of the nodes' shared estimate (:class:`GroupGradient`), else 0."""
        moment = self.second_moment
        return moment.share_second_moment_every if isinstance(moment, GroupGradient) else 0

    def flat(self) -> dict[str, Any]:
        """The options by their names in configuration files (None: not used): what
        :func:`make_setting` maps back onto this setting."""
        moment = self.second_moment
        return {
            "topology": self.topology.name if isinstance(self.topology, Topology) else self.topology,
            "exchange": self.exchange,
            "average_every": self.average_every,
            "intra_node": self.intra_node,
            "second_moment": moment.name,
            "v_every": moment.v_every if isinstance(moment, GroupGradient) else None,
            "share_second_moment_every": self.share_every if isinstance(moment, GroupGradient) else None,
            "accum_steps": self.accum_steps,
            "sync_steps": self.sync_steps,
        }

    def schedule(self, world_size: int, local_world_size: int) -> Topology:
        """The groups of every step for ``world_size`` ranks in nodes of ``local_world_size`` (the
        nodes' topology with ``intra_node="all_reduce"``, every ``average_every``-th step all ranks).

        Raises ValueError for what this job's size rules out, naming the fix.
        """
        if self.intra_node == "all_reduce":
            topology = over_nodes(self.topology, world_size, min(local_world_size, world_size))
            alone = topology.local_world_size == 1 and world_size > 1
            if isinstance(self.second_moment, GroupGradient) and alone:
                raise ValueError(
                    "second_moment='group_gradient' with intra_node='all_reduce' estimates the second "
                    "moment from the gradients of a node's ranks, but local_world_size is 1: give the "
                    "ranks per node (local_world_size, or LOCAL_WORLD_SIZE from the launcher), or use "
                    "intra_node='gossip'"
                )
        else:
            topology = resolve(self.topology, world_size, local_world_size)
        if communicates(topology):  # on one node of replicas (or one rank) there is nothing to average
            topology = with_global_average(topology, self.average_every)
        found = changing_groups(topology)
        if self.exchange == "bf16_updates" and found is not None and not has_global_round(topology):
            rank, groups = found
            where = "over the nodes " if self.intra_node == "all_reduce" else ""
            raise ValueError(
                f"exchange='bf16_updates' sends updates from a reference point that a rank shares "
                f"with every rank it averages with, but topology {topology.name!r} {where}gives rank "
                f"{rank} {len(groups)} different groups ({groups}) and never averages all ranks, where "
                "that point would be renewed: pass average_every=k (e.g. 16), use topology='complete', "
                "or exchange='parameters'"
            )
        if (
            isinstance(self.second_moment, Global)
            and communicates(topology)
            and not has_global_round(topology)
        ):
            raise ValueError(
                f"second_moment='global' averages the ranks' second moments at the exact averages over "
                f"all ranks, but topology {topology.name!r} has none: pass average_every=k (e.g. 16) "
                "or topology='complete'"
            )
        return topology

    def moment_source(self, topology: Topology) -> MomentSource:
        """What the AccumAdamW update divides by on ``topology`` (:meth:`schedule`'s): ``n`` the
        ranks (nodes with ``intra_node="all_reduce"``) but for :class:`Local`."""
        if isinstance(self.second_moment, Local):
            return MomentSource()
        nodes = self.intra_node == "all_reduce"
        noise_ranks = topology.world_size // (topology.local_world_size if nodes else 1)
        return MomentSource(
            noise_ranks=noise_ranks,
            # the nodes' mean estimate may ask a node for N times its own step (exchanges.moments)
            floor_ranks=noise_ranks * noise_ranks if self.share_every else None,
            estimate_every=self.v_every,
            shared=isinstance(self.second_moment, Global),
        )


DEFAULT_SETTING = "default"
"""The name of the setting ``DecentralizedAdam(params, lr)`` uses."""

SETTINGS: Mapping[str, Setting] = MappingProxyType(
    {
        DEFAULT_SETTING: Setting(),
        # the paper's AccumAdam (Wang et al.): AER, float32 parameters, every rank a worker of the
        # graph, each rank's own second moment, a window of 4
        "accumadam": Setting(
            topology="aer",
            exchange="parameters",
            average_every=0,
            intra_node="gossip",
            second_moment=Local(accum_steps=4),
        ),
        # nodes of several ranks: gradients all-reduced in the node, the nodes on the complete graph
        # with bfloat16 updates, their second moment shared every other step, a 300-step warm-up
        "nodes-complete-bf16": Setting(
            topology="complete",
            exchange="bf16_updates",
            average_every=0,
            intra_node="all_reduce",
            second_moment=GroupGradient(share_second_moment_every=2),
            sync_steps=300,
        ),
    }
)
"""The settings a user picks from, by name (docs/choosing.md)."""


def make_setting(
    setting: Setting | str | None = None,
    *,
    topology: str | Topology | None = None,
    exchange: str | None = None,
    average_every: int | None = None,
    intra_node: str | None = None,
    second_moment: SecondMoment | str | None = None,
    v_every: int | None = None,
    share_second_moment_every: int | None = None,
    accum_steps: int | None = None,
    sync_steps: int | None = None,
) -> Setting:
    """``setting`` with the options configuration files hold flat (None: not given).

    ``setting`` is a name of :data:`SETTINGS`, a :class:`Setting`, or None: the default, or
    ``"accumadam"`` where ``accum_steps > 1`` is given without a second moment (the paper writes
    AccumAdam so). A given ``second_moment`` replaces the setting's with that kind and its
    defaults; ``v_every``, ``share_second_moment_every`` and ``accum_steps`` set its parameters,
    and one that the kind does not have is refused (``accum_steps=1`` and
    ``share_second_moment_every=0`` mean "none" and go with any kind). Raises ValueError naming the
    value and the fix: the one home of the rules that :class:`Setting` cannot express alone.
    """
    if setting is None:
        window = accum_steps is not None and is_count(accum_steps, 2) and second_moment is None
        setting = "accumadam" if window else DEFAULT_SETTING
    if isinstance(setting, str):
        if setting not in SETTINGS:
            raise ValueError(
                f"unknown setting {setting!r}: choose one of {', '.join(map(repr, sorted(SETTINGS)))} "
                "(docs/choosing.md), or pass a Setting"
            )
        base = SETTINGS[setting]
    elif isinstance(setting, Setting):
        base = setting
    else:
        raise TypeError(f"setting must be a name of SETTINGS or a Setting, got {setting!r}")
    if second_moment is None:
        moment = base.second_moment
    else:
        moment = _second_moment_named(second_moment) if isinstance(second_moment, str) else second_moment
    moment = _with_parameters(moment, v_every, share_second_moment_every, accum_steps)
    given: dict[str, Any] = {
        "topology": topology,
        "exchange": exchange,
        "average_every": average_every,
        "intra_node": intra_node,
        "sync_steps": sync_steps,
    }
    return dataclasses.replace(
        base, second_moment=moment, **{k: v for k, v in given.items() if v is not None}
    )


FLAT_OPTIONS = (
    "topology",
    "exchange",
    "average_every",
    "intra_node",
    "second_moment",
    "v_every",
    "share_second_moment_every",
    "accum_steps",
    "sync_steps",
)
"""The options a configuration holds flat, by the names of :func:`make_setting`'s keywords."""


def setting_of(config: Any) -> Setting:
    """:func:`make_setting` of a configuration's ``setting`` and its :data:`FLAT_OPTIONS` attributes
    (the recipes' ``[optim]`` section, the Trainer's arguments, fairseq2's optimizer config)."""
    return make_setting(config.setting, **{name: getattr(config, name) for name in FLAT_OPTIONS})


def _with_parameters(
    moment: SecondMoment, v_every: int | None, share_every: int | None, accum_steps: int | None
) -> SecondMoment:
    """``moment`` with the flat parameters given; one its kind does not have is refused."""
    if accum_steps is not None:
        if isinstance(moment, Local):
            moment = dataclasses.replace(moment, accum_steps=accum_steps)
        elif not is_count(accum_steps, 1):
            Local(accum_steps)  # raises: the window's own check
        elif accum_steps > 1:
            raise ValueError(
                f"accum_steps={accum_steps} is the accumulation window of the paper's AccumAdam, but "
                f"second_moment={moment.name!r} estimates the second moment of single-step gradients: "
                f"use setting='accumadam' (its window with accum_steps={accum_steps}) or "
                "second_moment='local', or accum_steps=1"
            )
    if v_every is not None:
        if not isinstance(moment, GroupGradient):
            raise ValueError(
                f"v_every={v_every!r} says how often second_moment='group_gradient' sends the gradient, "
                f"but second_moment={moment.name!r}: pass second_moment='group_gradient' with it, or "
                "leave v_every out"
            )
        moment = dataclasses.replace(moment, v_every=v_every)
    if share_every is not None:
        if isinstance(moment, GroupGradient):
            moment = dataclasses.replace(moment, share_second_moment_every=share_every)
        elif share_every != 0:
            raise ValueError(
                f"share_second_moment_every={share_every!r} shares the nodes' second_moment="
                f"'group_gradient' estimate, but second_moment={moment.name!r}: pass "
                "intra_node='all_reduce', second_moment='group_gradient' with it, or leave it out"
            )
    return moment


# ---------------------------------------------------------------------------- communication


@dataclass(frozen=True)
class Comm:
    """How this job's ranks are laid out and talk: nothing here changes a step's arithmetic (but
    ``local_update``, which benchmarks use to emulate another device's update)."""

    local_world_size: int | None = None
    """Ranks per node (consecutive ranks) for node-aware topologies ("aer") and ``intra_node``;
    None: the ``LOCAL_WORLD_SIZE`` that torchrun and accelerate launch set, else 1."""
    process_group: torch.distributed.ProcessGroup | None = None
    """The ranks that train together (None: the world)."""
    bucket_size_mb: float = 25.0
    """Target size of one communication bucket (:mod:`decentadam.buckets`)."""
    overlap: Overlap = "step"
    """``"step"``: the exchange overlaps the next forward/backward; ``"backward"``: each bucket is
    also updated from gradient hooks once its gradients are final (:mod:`decentadam.backward`), which
    cannot go with global gradient-norm clipping, fp16 loss scalers or gradient accumulation."""
    timeout: float | None = None
    """Seconds to wait for one exchange before raising (a peer died or stalled); None leaves it to
    the process group's timeout, the better place with NCCL (where a timeout makes every wait block
    the CPU, torch's ``Work.wait`` semantics)."""
    hierarchical: bool = True
    """On gloo with CPU parameters, sum groups that span several nodes in three phases
    (:mod:`decentadam.collectives`); False: one flat all-reduce per group. Default communicator only."""
    communicator: Communicator | None = None
    """Replaces the ``torch.distributed`` collectives (tests, :mod:`decentadam.simulation`)."""
    local_update: LocalUpdate | None = None
    """Replaces the AccumAdamW update of one bucket (:data:`LocalUpdate`); default: AccumAdamW's."""

    def __post_init__(self) -> None:
        if self.local_world_size is not None and not is_count(self.local_world_size, 1):
            raise ValueError(
                f"local_world_size must be an integer >= 1 or None, got {self.local_world_size!r}"
            )
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.overlap not in ("step", "backward"):
            raise ValueError(f"overlap must be 'step' or 'backward', got {self.overlap!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {self.timeout}")
        if self.communicator is not None and not self.hierarchical:
            raise ValueError(
                "hierarchical=False configures the default communicator, but communicator= was given; "
                "build it as ProcessGroupCommunicator(topology, process_group, hierarchical=False) "
                "instead, or leave communicator= out"
            )
