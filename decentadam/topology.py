"""Communication topologies: which ranks average their parameters together at each step.

A topology is plain data. It is a periodic schedule of *rounds*; a round is a list of disjoint
groups of ranks that together cover every rank, and each group averages its members' parameters
uniformly. Step ``t`` uses round ``t % period``. Nothing here touches ``torch.distributed``: the
schedule can be built, inspected and tested on a laptop.

Names (``build(name, world_size, local_world_size)``):

``complete``
    One group of all ranks every step: exact averaging (the parameter analogue of All-Reduce).
``ring``
    ``world_size`` even. Even steps pair ``(2i, 2i+1)``, odd steps pair ``(2i-1, 2i)`` (mod n);
    every rank averages with one neighbour, alternately left and right.
``one-peer-exp``
    ``world_size = 2**r``. Round ``k`` (``0 <= k < r``) pairs rank ``j`` with ``j + 2**k`` (that is,
    ``j XOR 2**k``). After ``r`` rounds every rank holds the exact average.
``aer`` (alternating exponential ring)
    Nodes of ``local_world_size`` consecutive ranks, ``N = world_size / local_world_size = 2**r``
    nodes. Node pairs of round ``k`` are ``j <-> j XOR 2**k``. Each node pair spends two steps on
    round ``k``: in one step the two nodes average together (a group of ``2L`` ranks over the slow
    inter-node link), in the other each node averages inside itself (groups of ``L`` ranks, fast
    intra-node link). Pairs are phased so that at any step half of the pairs use the slow link:
    at step ``2k`` the odd-indexed pairs (pairs numbered by their lower node) go inter-node, at step
    ``2k + 1`` the even-indexed ones. Period ``2r``. With ``L = 1`` the intra-node steps are rests
    (a group of one rank does not communicate): a one-peer exponential schedule with rest steps.
    With a single node (``N = 1``) there is no slow link to economise: every step averages the
    whole node, which is the ``complete`` topology.

Every topology accepts ``world_size = 1`` (one group of one rank: no communication at all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

Group = tuple[int, ...]
Round = tuple[Group, ...]

__all__ = [
    "TOPOLOGIES",
    "Group",
    "Round",
    "Topology",
    "build",
    "changing_groups",
    "communicates",
    "has_global_round",
    "over_nodes",
    "resolve",
    "with_global_average",
]


@dataclass(frozen=True)
class Topology:
    """A periodic schedule of rank groups that average uniformly.

    Attributes:
        name: the registry name it was built from.
        world_size: number of ranks.
        local_world_size: ranks per node (consecutive ranks share a node).
        rounds: ``rounds[t % period]`` are the groups of step ``t``; each round is a partition of
            ``range(world_size)`` into groups with sorted members.
    """

    name: str
    world_size: int
    local_world_size: int
    rounds: tuple[Round, ...]
    _matrices: tuple[torch.Tensor, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rounds:
            raise ValueError(f"topology {self.name!r} has no rounds")
        for index, groups in enumerate(self.rounds):
            members = sorted(rank for group in groups for rank in group)
            if members != list(range(self.world_size)):
                raise ValueError(
                    f"round {index} of topology {self.name!r} is not a partition of ranks "
                    f"0..{self.world_size - 1}: {groups}"
                )
        object.__setattr__(self, "_matrices", tuple(self._round_matrix(groups) for groups in self.rounds))

    @property
    def period(self) -> int:
        """Number of distinct rounds; step ``t`` uses round ``t % period``."""
        return len(self.rounds)

    def groups(self, step: int) -> list[Group]:
        """The disjoint groups (covering all ranks) that average at ``step``."""
        return list(self.rounds[step % self.period])

    def group_of(self, rank: int, step: int) -> Group:
        """The group that ``rank`` averages with at ``step`` (itself alone means no communication)."""
        for group in self.rounds[step % self.period]:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is outside world_size {self.world_size}")

    def distinct_groups(self) -> list[Group]:
        """Every group of more than one rank used by some round, in a fixed order.

        All ranks must create their communicators in the same order; this is that order.
        """
        seen: dict[Group, None] = {}
        for groups in self.rounds:
            for group in groups:
                if len(group) > 1:
                    seen.setdefault(group, None)
        return list(seen)

    def mixing_matrix(self, step: int) -> torch.Tensor:
        """W(step): float64, world_size x world_size, doubly stochastic; row i is what rank i averages."""
        return self._matrices[step % self.period].clone()

    def period_product(self) -> torch.Tensor:
        """W(period - 1) @ ... @ W(1) @ W(0): the mixing done by one full period."""
        product = torch.eye(self.world_size, dtype=torch.float64)
        for matrix in self._matrices:
            product = matrix @ product
        return product

    def spectral_gap(self) -> float:
        """1 - |lambda_2| of the product of W over one period (1.0 means one period averages exactly)."""
        if self.world_size == 1:
            return 1.0
        moduli = torch.linalg.eigvals(self.period_product()).abs().sort(descending=True).values
        return float(1.0 - moduli[1].item())

    def _round_matrix(self, groups: Round) -> torch.Tensor:
        matrix = torch.zeros(self.world_size, self.world_size, dtype=torch.float64)
        for group in groups:
            index = torch.tensor(group)
            matrix[index.unsqueeze(1), index.unsqueeze(0)] = 1.0 / len(group)
        return matrix


def _log2_exact(value: int) -> int | None:
    """r such that value == 2**r, or None."""
    if value < 1 or value & (value - 1):
        return None
    return int(math.log2(value))


def _complete(world_size: int, local_world_size: int) -> list[Round]:
    return [(tuple(range(world_size)),)]


def _ring(world_size: int, local_world_size: int) -> list[Round]:
    if world_size % 2:
        raise ValueError(f"ring needs an even world_size (ranks pair up), got {world_size}")
    even = tuple((i, i + 1) for i in range(0, world_size, 2))
    odd = tuple(tuple(sorted((i, (i - 1) % world_size))) for i in range(0, world_size, 2))
    return [even, odd]


def _one_peer_exp(world_size: int, local_world_size: int) -> list[Round]:
    r = _log2_exact(world_size)
    if r is None:
        raise ValueError(
            f"one-peer-exp needs world_size to be a power of two (the number of nodes where a node's ranks "
            f"all-reduce their gradients, the default), got {world_size}: use topology='complete' (every "
            "step an exact average, still overlapped) or a power-of-two number of nodes"
        )
    return [tuple((j, j + 2**k) for j in range(world_size) if not j & 2**k) for k in range(r)]


def _aer(world_size: int, local_world_size: int) -> list[Round]:
    nodes, remainder = divmod(world_size, local_world_size)
    if remainder:
        raise ValueError(
            "aer needs world_size to be a multiple of local_world_size, "
            f"got {world_size} and {local_world_size}"
        )
    r = _log2_exact(nodes)
    if r is None:
        raise ValueError(
            f"aer needs world_size / local_world_size to be a power of two, got {world_size} / "
            f"{local_world_size} = {nodes} nodes"
        )
    if r == 0:
        return _complete(world_size, local_world_size)

    def node(j: int) -> Group:
        return tuple(range(j * local_world_size, (j + 1) * local_world_size))

    rounds: list[Round] = []
    for k in range(r):
        pairs = [(j, j + 2**k) for j in range(nodes) if not j & 2**k]
        for phase in (1, 0):  # step 2k: odd-indexed pairs go inter-node; step 2k+1: even-indexed ones
            groups: list[Group] = []
            for index, (a, b) in enumerate(pairs):
                if index % 2 == phase:
                    groups.append(node(a) + node(b))
                else:
                    groups.extend((node(a), node(b)))
            rounds.append(tuple(sorted(groups)))
    return rounds


TOPOLOGIES: Mapping[str, Callable[[int, int], list[Round]]] = MappingProxyType(
    {
        "complete": _complete,
        "ring": _ring,
        "one-peer-exp": _one_peer_exp,
        "aer": _aer,
    }
)


def build(name: str, world_size: int, local_world_size: int = 1) -> Topology:
    """Build the named topology for ``world_size`` ranks in nodes of ``local_world_size`` ranks.

    Raises:
        ValueError: unknown name, or sizes the topology cannot be built for (the message names the
            constraint).
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; choose one of {sorted(TOPOLOGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    if world_size == 1:
        rounds: list[Round] = [((0,),)]
    else:
        rounds = TOPOLOGIES[name](world_size, local_world_size)
    return Topology(name=name, world_size=world_size, local_world_size=local_world_size, rounds=tuple(rounds))


def resolve(topology: str | Topology, world_size: int, local_world_size: int) -> Topology:
    """``topology`` itself if it is built (checked against ``world_size``), else ``build(topology, ...)``."""
    if not isinstance(topology, Topology):
        return build(topology, world_size, local_world_size)
    if topology.world_size != world_size:
        raise ValueError(
            f"topology {topology.name!r} is built for {topology.world_size} ranks, but {world_size} "
            "are training"
        )
    return topology


def over_nodes(topology: str | Topology, world_size: int, local_world_size: int) -> Topology:
    """``topology`` among the nodes, for ranks that average their gradients inside their node.

    ``Setting(intra_node="all_reduce")``: the ranks of a node (``local_world_size``
    consecutive ranks) hold the same parameters, so only nodes average. ``topology`` (a name, or a
    :class:`Topology` built for ``world_size / local_world_size`` ranks) is the schedule of the
    ``N`` nodes, each node acting as one rank of it (a name is built with ``local_world_size=1``);
    each of its groups becomes the group of all ranks of its nodes, and a node alone does not
    communicate (its ranks are groups of one). The result is built for ``world_size`` ranks in
    nodes of ``local_world_size``, with the nodes' topology's name.
    """
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"averaging gradients inside nodes needs world_size to be a multiple of local_world_size, "
            f"got {world_size} and {local_world_size}"
        )
    nodes = world_size // local_world_size
    if isinstance(topology, Topology):
        if topology.world_size != nodes:
            raise ValueError(
                f"topology {topology.name!r} is built for {topology.world_size} ranks, but with the "
                f"gradients averaged inside nodes it schedules the {nodes} nodes of {local_world_size} "
                f"ranks: build it for {nodes}"
            )
        among_nodes = topology
    else:
        among_nodes = build(topology, nodes, 1)

    def ranks(node: int) -> Group:
        return tuple(range(node * local_world_size, (node + 1) * local_world_size))

    rounds: list[Round] = []
    for groups in among_nodes.rounds:
        expanded: list[Group] = []
        for group in groups:
            if len(group) == 1:
                expanded.extend((rank,) for rank in ranks(group[0]))
            else:
                expanded.append(tuple(rank for node in group for rank in ranks(node)))
        rounds.append(tuple(sorted(expanded)))
    return Topology(
        name=among_nodes.name, world_size=world_size, local_world_size=local_world_size, rounds=tuple(rounds)
    )


def with_global_average(topology: Topology, every: int) -> Topology:
    """``topology`` with every ``every``-th step an exact average: the group of all ranks.

    Round ``t`` is the group of every rank where ``t % every == 0`` and ``topology``'s round
    ``t % period`` otherwise; the period becomes ``lcm(period, every)``. ``every=1`` is ``complete``;
    ``every=0`` returns ``topology`` unchanged. (Step 0 never mixes: every rank starts from the same
    weights; the first exact average is at step ``every``.) The name says both:
    ``"one-peer-exp+avg16"``.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"the exact average's period must be an integer >= 0 (0: never), got {every!r}")
    if every == 0 or topology.world_size == 1:
        return topology
    world: Round = (tuple(range(topology.world_size)),)
    period = math.lcm(topology.period, every)
    rounds = tuple(world if t % every == 0 else topology.rounds[t % topology.period] for t in range(period))
    return Topology(
        name=f"{topology.name}+avg{every}",
        world_size=topology.world_size,
        local_world_size=topology.local_world_size,
        rounds=rounds,
    )


def communicates(topology: Topology) -> bool:
    """Whether some step has a group of more than one rank (else no rank ever sends anything)."""
    return any(len(group) > 1 for groups in topology.rounds for group in groups)


def has_global_round(topology: Topology) -> bool:
    """Whether some step averages every rank exactly (one group of all ranks)."""
    return any(len(groups) == 1 for groups in topology.rounds)


def changing_groups(topology: Topology) -> tuple[int, list[Group]] | None:
    """``(rank, its groups)`` for the first rank that averages with more than one group over the
    schedule (its groups of one left out), or ``None`` when every rank has one fixed group (what
    ``Setting(exchange="bf16_updates")`` needs without exact averages)."""
    for rank in range(topology.world_size):
        groups = {topology.group_of(rank, t) for t in range(topology.period)} - {(rank,)}
        if len(groups) > 1:
            return rank, sorted(groups)
    return None
