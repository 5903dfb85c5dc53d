"""Communication graphs of asynchronous gossip: which pairs of ranks may average together.

Synchronous gossip follows a :class:`~decentadam.topology.Topology`, a schedule saying who averages
at each step. Asynchronous gossip (:class:`decentadam.A2CiD2`) has no steps in common: any two
neighbours on a fixed undirected graph average whenever both are free. A :class:`Graph` is that
plain data (ranks and edges), with its Laplacian; nothing here touches ``torch.distributed``.

Names (``build_graph(name, world_size)``):

``ring``
    The cycle ``i <-> i + 1 (mod n)``: two neighbours per rank (one for ``n = 2``).
``exp``
    The exponential graph: ``i <-> i +- 2**k (mod n)`` for every ``2**k < n``, each neighbour
    counted once (``n = 16``: 7 neighbours, ``+-1, +-2, +-4, 8``).
``complete``
    Every pair of ranks.

A built :class:`~decentadam.topology.Topology` also gives a graph (:func:`as_graph`): two ranks are
neighbours when some round puts them in one group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from decentadam.topology import Topology

__all__ = ["GRAPHS", "Edge", "Graph", "as_graph", "build_graph"]

Edge = tuple[int, int]


@dataclass(frozen=True)
class Graph:
    """An undirected graph on ranks ``0 .. world_size - 1``.

    Attributes:
        name: the registry name (or the topology's name) it was built from.
        world_size: number of ranks.
        edges: sorted pairs ``(i, j)`` with ``i < j``, each once, in sorted order.
    """

    name: str
    world_size: int
    edges: tuple[Edge, ...]
    _neighbours: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"graph {self.name!r}: edges must be sorted and unique, got {self.edges}")
        for i, j in self.edges:
            if not 0 <= i < j < self.world_size:
                raise ValueError(
                    f"graph {self.name!r}: edge ({i}, {j}) is not a pair i < j of ranks "
                    f"0..{self.world_size - 1}"
                )
        adjacent: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, j in self.edges:
            adjacent[i].append(j)
            adjacent[j].append(i)
        object.__setattr__(self, "_neighbours", tuple(tuple(sorted(a)) for a in adjacent))

    def neighbours(self, rank: int) -> tuple[int, ...]:
        """The ranks that ``rank`` may average with, sorted."""
        return self._neighbours[rank]

    def degree(self, rank: int) -> int:
        return len(self._neighbours[rank])

    def is_connected(self) -> bool:
        seen, frontier = {0}, [0]
        while frontier:
            rank = frontier.pop()
            for other in self._neighbours[rank]:
                if other not in seen:
                    seen.add(other)
                    frontier.append(other)
        return len(seen) == self.world_size

    def laplacian(self, rate: float) -> torch.Tensor:
        """``L = rate * (I - W)``, float64: the intensities of the pairwise averagings.

        ``W_ij = 1 / max(deg i, deg j)`` on edges and ``W_ii = 1 - sum_j W_ij``, so ``W`` is
        symmetric and doubly stochastic and every rank averages at most ``rate`` times per unit of
        time. On a regular graph (``W_ij = 1 / deg``) this is each rank averaging ``rate`` times
        with a neighbour drawn uniformly, which the matchmaker makes true when the ranks run alike:
        it draws the partner uniformly among the ready neighbours
        (:class:`~decentadam.asynchronous.pairing.Matchmaker`). On an irregular graph it is an
        approximation: the matchmaker lets a low-degree rank average ``rate`` times too.
        """
        n = self.world_size
        matrix = torch.zeros(n, n, dtype=torch.float64)
        for i, j in self.edges:
            weight = 1.0 / max(self.degree(i), self.degree(j))
            matrix[i, j] = matrix[j, i] = -rate * weight
        matrix -= torch.diag(matrix.sum(dim=1))
        return matrix


def _ring(world_size: int) -> set[Edge]:
    return {_edge(i, (i + 1) % world_size) for i in range(world_size)}


def _exp(world_size: int) -> set[Edge]:
    edges: set[Edge] = set()
    hop = 1
    while hop < world_size:
        edges.update(_edge(i, (i + hop) % world_size) for i in range(world_size))
        hop *= 2
    return edges


def _complete(world_size: int) -> set[Edge]:
    return {(i, j) for i in range(world_size) for j in range(i + 1, world_size)}


def _edge(i: int, j: int) -> Edge:
    return (min(i, j), max(i, j))


GRAPHS: Mapping[str, Callable[[int], set[Edge]]] = MappingProxyType(
    {"ring": _ring, "exp": _exp, "complete": _complete}
)


def build_graph(name: str, world_size: int) -> Graph:
    """The named graph on ``world_size`` ranks (see the module docstring)."""
    if name not in GRAPHS:
        raise ValueError(f"unknown graph {name!r}; choose one of {sorted(GRAPHS)}, or pass a Topology")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    edges = {(i, j) for i, j in GRAPHS[name](world_size) if i != j}
    return Graph(name=name, world_size=world_size, edges=tuple(sorted(edges)))


def as_graph(graph: str | Graph | Topology, world_size: int) -> Graph:
    """A graph for ``world_size`` ranks from a name, a built graph, or a topology's rounds."""
    if isinstance(graph, str):
        return build_graph(graph, world_size)
    if graph.world_size != world_size:
        raise ValueError(
            f"graph {graph.name!r} is built for {graph.world_size} ranks, but {world_size} are training"
        )
    if isinstance(graph, Graph):
        return graph
    edges = {(a, b) for groups in graph.rounds for group in groups for a in group for b in group if a < b}
    return Graph(name=graph.name, world_size=world_size, edges=tuple(sorted(edges)))
