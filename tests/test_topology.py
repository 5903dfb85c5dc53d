"""Topologies are plain data: every check here runs without a process group.

The expected schedules are rebuilt independently from their statement in
docs/overlap-and-topologies.md, Topologies (partner ranks, group sizes, phasing; sources in
docs/algorithms.md) and compared with what ``decentadam.topology.build`` produces.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from decentadam.topology import (
    TOPOLOGIES,
    Group,
    Topology,
    build,
    changing_groups,
    has_global_round,
    over_nodes,
    with_global_average,
)

NAMES = ("complete", "ring", "one-peer-exp", "aer")
WORLD_SIZES = (1, 2, 4, 8, 16)
LOCAL_WORLD_SIZES = (1, 2, 4)

# Every (name, world_size, local_world_size) the grid allows: a node cannot hold more ranks than the
# world, and nodes must tile the world. All world sizes are powers of two, so every name is valid.
CONFIGS = [
    (name, world_size, local_world_size)
    for name in NAMES
    for world_size in WORLD_SIZES
    for local_world_size in LOCAL_WORLD_SIZES
    if local_world_size <= world_size and world_size % local_world_size == 0
]
AER_MULTI_NODE = [
    (world_size, local_world_size)
    for name, world_size, local_world_size in CONFIGS
    if name == "aer" and world_size // local_world_size >= 2
]


def _ids(config: tuple[object, ...]) -> str:
    return "-".join(str(part) for part in config)


def _node(j: int, local_world_size: int) -> Group:
    return tuple(range(j * local_world_size, (j + 1) * local_world_size))


def _expected_matrix(groups: list[Group], world_size: int) -> torch.Tensor:
    """W built entry by entry: 1/|g| between members of the same group g, 0 elsewhere."""
    rows = [[0.0] * world_size for _ in range(world_size)]
    for group in groups:
        for i in group:
            for j in group:
                rows[i][j] = 1.0 / len(group)
    return torch.tensor(rows, dtype=torch.float64)


def _max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    # Plain arithmetic rather than torch.testing, whose first import alone costs about a second.
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    return float((actual - expected).abs().max())


@pytest.fixture(params=CONFIGS, ids=[_ids(config) for config in CONFIGS])
def topology(request: pytest.FixtureRequest) -> Topology:
    name, world_size, local_world_size = request.param
    return build(name, world_size, local_world_size)


# --- structure shared by every topology ------------------------------------------------------------


def test_registry_names() -> None:
    assert sorted(TOPOLOGIES) == sorted(NAMES)


def test_each_round_is_a_partition(topology: Topology) -> None:
    assert topology.period == len(topology.rounds) >= 1
    for step in range(topology.period):
        groups = topology.groups(step)
        members = [rank for group in groups for rank in group]
        assert sorted(members) == list(range(topology.world_size)), f"step {step}: {groups}"
        assert all(len(group) >= 1 and list(group) == sorted(group) for group in groups)
        for rank in range(topology.world_size):
            group = topology.group_of(rank, step)
            assert rank in group
            assert group in groups


def test_mixing_matrix_entries(topology: Topology) -> None:
    n = topology.world_size
    for step in range(topology.period):
        matrix = topology.mixing_matrix(step)
        assert matrix.dtype == torch.float64
        assert matrix.shape == (n, n)
        # Exact: 1/|g| inside a group, 0 outside.
        assert torch.equal(matrix, _expected_matrix(topology.groups(step), n)), f"step {step}"
        assert torch.equal(matrix, matrix.T)
        assert bool((matrix >= 0).all())
        assert _max_abs_diff(matrix.sum(dim=0), torch.ones(n, dtype=torch.float64)) <= 1e-12
        assert _max_abs_diff(matrix.sum(dim=1), torch.ones(n, dtype=torch.float64)) <= 1e-12
    topology.mixing_matrix(0).fill_(-1.0)
    assert bool((topology.mixing_matrix(0) >= 0).all()), "mixing_matrix returns a copy"


def test_mixing_matrix_is_periodic(topology: Topology) -> None:
    period = topology.period
    for step in range(2 * period + 1):
        matrix = topology.mixing_matrix(step)
        assert torch.equal(matrix, topology.mixing_matrix(step + period))
        assert torch.equal(matrix, topology.mixing_matrix(step % period))
        assert topology.groups(step) == topology.groups(step + period)


def test_distinct_groups(topology: Topology) -> None:
    distinct = topology.distinct_groups()
    used = {group for groups in topology.rounds for group in groups if len(group) > 1}
    assert len(distinct) == len(set(distinct)), "no duplicates"
    assert set(distinct) == used
    assert topology.distinct_groups() == distinct, "the order is fixed"


def test_period_product_is_the_ordered_product(topology: Topology) -> None:
    expected = torch.eye(topology.world_size, dtype=torch.float64)
    for step in range(topology.period):
        expected = topology.mixing_matrix(step) @ expected
    assert _max_abs_diff(topology.period_product(), expected) <= 1e-15


# --- exact averaging and spectral gap --------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [config for config in CONFIGS if config[0] in ("complete", "one-peer-exp", "aer")],
    ids=_ids,
)
def test_one_period_averages_exactly(config: tuple[str, int, int]) -> None:
    topology = build(*config)
    n = topology.world_size
    average = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    assert _max_abs_diff(topology.period_product(), average) <= 1e-12
    assert topology.spectral_gap() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("world_size", [6, 8, 10, 12, 16])
def test_ring_gap_is_strictly_between_zero_and_one(world_size: int) -> None:
    gap = build("ring", world_size).spectral_gap()
    assert 0.0 < gap < 1.0 - 1e-6


def test_ring_gap_shrinks_with_size() -> None:
    gaps = [build("ring", n).spectral_gap() for n in (6, 8, 12, 16)]
    assert gaps == sorted(gaps, reverse=True)


# --- per-name schedules ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 6, 8, 10, 16])
def test_ring_schedule(world_size: int) -> None:
    topology = build("ring", world_size)
    n = world_size
    assert topology.period == 2
    even = {(2 * i, 2 * i + 1) for i in range(n // 2)}
    odd = {tuple(sorted(((2 * i - 1) % n, 2 * i))) for i in range(n // 2)}
    assert set(topology.groups(0)) == even
    assert set(topology.groups(1)) == odd
    for step in range(4):
        for rank in range(n):
            if step % 2 == 0:
                partner = rank ^ 1  # (2i, 2i+1)
            elif rank % 2 == 0:
                partner = (rank - 1) % n  # (2i-1, 2i): even ranks look left
            else:
                partner = (rank + 1) % n  # odd ranks look right
            assert topology.group_of(rank, step) == tuple(sorted((rank, partner)))


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_one_peer_exp_schedule(world_size: int) -> None:
    topology = build("one-peer-exp", world_size)
    assert topology.period == int(math.log2(world_size))
    for k in range(topology.period):
        for rank in range(world_size):
            assert topology.group_of(rank, k) == tuple(sorted((rank, rank ^ 2**k)))


def test_complete_is_one_group() -> None:
    for name, world_size, local_world_size in CONFIGS:
        if name == "complete":
            topology = build(name, world_size, local_world_size)
            assert topology.rounds == ((tuple(range(world_size)),),)
            assert topology.distinct_groups() == ([tuple(range(world_size))] if world_size > 1 else [])


@pytest.mark.parametrize("sizes", AER_MULTI_NODE, ids=_ids)
def test_aer_schedule(sizes: tuple[int, int]) -> None:
    world_size, local_world_size = sizes
    topology = build("aer", world_size, local_world_size)
    nodes = world_size // local_world_size
    r = int(math.log2(nodes))
    assert topology.period == 2 * r

    for k in range(r):
        pairs = [(j, j ^ 2**k) for j in range(nodes) if j < j ^ 2**k]
        assert len(pairs) == nodes // 2
        inter_steps: dict[tuple[int, int], list[int]] = {pair: [] for pair in pairs}
        for step in (2 * k, 2 * k + 1):
            groups = set(topology.groups(step))
            inter = 0
            for pair in pairs:
                a, b = (_node(j, local_world_size) for j in pair)
                if a + b in groups:  # one group of 2L ranks over the inter-node link
                    inter += 1
                    inter_steps[pair].append(step)
                else:  # each node averages inside itself
                    assert a in groups and b in groups, f"step {step}, node pair {pair}: {sorted(groups)}"
            assert inter in (len(pairs) // 2, (len(pairs) + 1) // 2), f"step {step}: {inter} inter-node"
            if local_world_size == 1:
                singletons = [group for group in groups if len(group) == 1]
                assert len(singletons) == 2 * (len(pairs) - inter), "intra-node steps are rests"
        for pair, steps in inter_steps.items():
            assert len(steps) == 1, f"round {k}, node pair {pair} went inter-node at steps {steps}"


@pytest.mark.parametrize("sizes", AER_MULTI_NODE, ids=_ids)
def test_aer_phasing_matches_docstring(sizes: tuple[int, int]) -> None:
    """Step 2k: odd-indexed pairs (numbered by their lower node) go inter-node; step 2k+1: even ones."""
    world_size, local_world_size = sizes
    topology = build("aer", world_size, local_world_size)
    nodes = world_size // local_world_size
    for k in range(topology.period // 2):
        pairs = [(j, j + 2**k) for j in range(nodes) if not j & 2**k]
        for index, (a, b) in enumerate(pairs):
            merged = _node(a, local_world_size) + _node(b, local_world_size)
            inter_step = 2 * k if index % 2 == 1 else 2 * k + 1
            assert merged in topology.groups(inter_step)
            assert merged not in topology.groups(inter_step ^ 1)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_aer_with_one_rank_per_node_is_one_peer_exp_with_rests(world_size: int) -> None:
    aer = build("aer", world_size, 1)
    exp = build("one-peer-exp", world_size)
    for k in range(exp.period):
        # The two steps of round k together use exactly one-peer-exp's pairs of round k.
        pairs = {group for step in (2 * k, 2 * k + 1) for group in aer.groups(step) if len(group) > 1}
        assert pairs == set(exp.groups(k))
    assert set(aer.distinct_groups()) == set(exp.distinct_groups())


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_aer_with_one_node_is_complete(world_size: int) -> None:
    aer = build("aer", world_size, world_size)
    complete = build("complete", world_size, world_size)
    assert aer.rounds == complete.rounds
    assert torch.equal(aer.period_product(), complete.period_product())


# --- world_size 1 -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_world_size_one(name: str) -> None:
    topology = build(name, 1)
    assert topology.period == 1
    assert topology.rounds == (((0,),),)
    assert topology.groups(0) == [(0,)]
    assert topology.groups(7) == [(0,)]
    assert topology.group_of(0, 3) == (0,)
    assert topology.distinct_groups() == []
    assert torch.equal(topology.mixing_matrix(0), torch.ones(1, 1, dtype=torch.float64))
    assert topology.spectral_gap() == 1.0


# --- errors --------------------------------------------------------------------------------------


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown topology") as info:
        build("torus", 4)
    for name in NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("world_size", [3, 5, 7])
def test_ring_rejects_odd_world_size(world_size: int) -> None:
    with pytest.raises(ValueError, match="even") as info:
        build("ring", world_size)
    assert str(world_size) in str(info.value)


@pytest.mark.parametrize("world_size", [3, 6, 12])
def test_one_peer_exp_rejects_non_power_of_two(world_size: int) -> None:
    with pytest.raises(ValueError, match="power of two") as info:
        build("one-peer-exp", world_size)
    assert str(world_size) in str(info.value)


def test_aer_rejects_non_power_of_two_nodes() -> None:
    with pytest.raises(ValueError, match="power of two") as info:
        build("aer", 12, 2)
    assert re.search(r"\b6\b", str(info.value)), "the message names the 6 nodes"


def test_aer_rejects_partial_nodes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        build("aer", 6, 4)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world_size", [0, -1])
def test_rejects_empty_world(name: str, world_size: int) -> None:
    with pytest.raises(ValueError, match="world_size"):
        build(name, world_size)


@pytest.mark.parametrize("name", NAMES)
def test_rejects_empty_node(name: str) -> None:
    with pytest.raises(ValueError, match="local_world_size"):
        build(name, 4, 0)


def test_topology_rejects_a_round_that_is_not_a_partition() -> None:
    with pytest.raises(ValueError, match="partition"):
        Topology(name="bad", world_size=3, local_world_size=1, rounds=(((0, 1), (1, 2)),))
    with pytest.raises(ValueError, match="partition"):
        Topology(name="bad", world_size=3, local_world_size=1, rounds=(((0, 1),),))
    with pytest.raises(ValueError, match="no rounds"):
        Topology(name="bad", world_size=1, local_world_size=1, rounds=())


@pytest.mark.parametrize(
    ("name", "world_size", "local_world_size"), [("aer", 4, 2), ("ring", 8, 2), ("one-peer-exp", 8, 2)]
)
def test_over_nodes_averages_whole_nodes_on_the_nodes_schedule(
    name: str, world_size: int, local_world_size: int
) -> None:
    topology = over_nodes(name, world_size, local_world_size)
    nodes = build(name, world_size // local_world_size, 1)
    assert (topology.name, topology.world_size, topology.local_world_size) == (
        name,
        world_size,
        local_world_size,
    )
    assert topology.period == nodes.period
    within = torch.full((local_world_size, local_world_size), 1.0 / local_world_size, dtype=torch.float64)
    for t in range(nodes.period):  # on ranks that hold their node's parameters, W acts as W_nodes
        for group in topology.groups(t):
            assert len(group) == 1 or len(group) % local_world_size == 0
            assert len(group) == 1 or group[0] % local_world_size == 0
        expected = torch.kron(nodes.mixing_matrix(t), within)
        replicas = torch.kron(
            torch.randn(nodes.world_size, 3, dtype=torch.float64),
            torch.ones(local_world_size, 1, dtype=torch.float64),
        )
        torch.testing.assert_close(
            topology.mixing_matrix(t) @ replicas, expected @ replicas, rtol=0, atol=1e-15
        )


def test_over_nodes_with_a_node_alone_does_not_communicate() -> None:
    topology = over_nodes("aer", 4, 2)  # two nodes: aer with one rank per node rests every other step
    assert topology.rounds == (((0,), (1,), (2,), (3,)), ((0, 1, 2, 3),))
    assert over_nodes("complete", 4, 4).distinct_groups() == []


def test_over_nodes_takes_a_topology_built_for_the_nodes() -> None:
    assert over_nodes(build("ring", 4), 8, 2).rounds == over_nodes("ring", 8, 2).rounds
    with pytest.raises(ValueError, match="build it for 4"):
        over_nodes(build("ring", 8), 8, 2)
    with pytest.raises(ValueError, match="multiple of local_world_size, got 6 and 4"):
        over_nodes("ring", 6, 4)


@pytest.mark.parametrize(
    ("name", "world_size", "every"), [("one-peer-exp", 16, 16), ("aer", 8, 3), ("ring", 4, 1)]
)
def test_with_global_average_puts_the_world_group_every_k_steps(
    name: str, world_size: int, every: int
) -> None:
    base = build(name, world_size)
    topology = with_global_average(base, every)
    assert topology.period == math.lcm(base.period, every)
    assert topology.name == f"{name}+avg{every}"
    world = [tuple(range(world_size))]
    for t in range(3 * topology.period):
        assert topology.groups(t) == (world if t % every == 0 else base.groups(t)), t
    assert has_global_round(topology)
    assert topology.spectral_gap() == pytest.approx(1.0)  # a period ends in an exact average
    if every > 1:
        assert changing_groups(topology) is not None


def test_with_global_average_zero_is_the_topology_and_bad_periods_are_refused() -> None:
    base = build("one-peer-exp", 8)
    assert with_global_average(base, 0) is base
    assert not has_global_round(base)
    assert has_global_round(build("complete", 8))
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="an integer >= 0"):
            with_global_average(base, bad)  # type: ignore[arg-type]


def test_communicates_is_whether_any_group_has_two_ranks() -> None:
    from decentadam.topology import communicates

    assert communicates(build("ring", 4)) and communicates(over_nodes("one-peer-exp", 4, 2))
    assert not communicates(build("complete", 1))
    assert not communicates(over_nodes("one-peer-exp", 4, 4))  # one node: its ranks are replicas
