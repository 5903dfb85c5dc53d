"""The runtime model's side of the benchmark: the node link rate that makes All-Reduce
communication-bound by a chosen ratio (and the bisection that solves it, :func:`solve`)."""

from __future__ import annotations

import math
from collections.abc import Callable

from benchmarks.time_to_quality.methods import NODES, RANKS_PER_NODE
from decentadam.runtime_model import ALLREDUCE, Cluster, Workload, predict


def allreduce_comm_s(
    rate_mbit: float, param_bytes: float, nodes: int = NODES, ranks_per_node: int = RANKS_PER_NODE
) -> float:
    """All-Reduce's communication per iteration on ``nodes x ranks_per_node`` with node links of
    ``rate_mbit`` (the runtime model's ``comm_s``; transfers inside a node taken as free)."""
    cluster = Cluster(
        nodes, ranks_per_node, inter_bytes_per_s=rate_mbit * 1e6 / 8, intra_bytes_per_s=math.inf
    )
    return predict(ALLREDUCE, cluster, Workload(param_bytes=param_bytes, compute_s=0.0)).comm_s


def solve_rate_mbit(
    compute_s: float,
    param_bytes: float,
    ratio: float = 1.5,
    nodes: int = NODES,
    ranks_per_node: int = RANKS_PER_NODE,
) -> float:
    """The node link rate (Mbit/s) at which All-Reduce communicates ``ratio x compute_s`` per iteration.

    Bisection on the runtime model (communication falls as the rate rises), to 3 significant digits.
    """
    if not compute_s > 0 or not param_bytes > 0 or not ratio > 0:
        raise ValueError(
            f"compute_s, param_bytes and ratio must be > 0, got {compute_s}, {param_bytes}, {ratio}"
        )

    def comm(mbit: float) -> float:
        return allreduce_comm_s(mbit, param_bytes, nodes, ranks_per_node)

    return float(f"{solve(comm, ratio * compute_s, 1e-3, 1e9, 'the link rate (Mbit/s)'):.3g}")


def solve(f: Callable[[float], float], target: float, low: float, high: float, what: str) -> float:
    """The ``x`` in [low, high] (both > 0) where ``f(x) = target``, ``f`` monotonic, by bisection on a
    log scale to a relative 1e-9; ValueError naming ``what`` when the target is outside f's range."""
    at_low, at_high = f(low), f(high)
    if not min(at_low, at_high) <= target <= max(at_low, at_high):
        raise ValueError(
            f"no {what} in [{low:g}, {high:g}] gives {target:g}: the range gives {at_low:g} to {at_high:g}"
        )
    rising = at_high > at_low
    for _ in range(200):
        middle = math.sqrt(low * high)
        if (f(middle) < target) == rising:
            low = middle
        else:
            high = middle
        if high / low < 1 + 1e-9:
            break
    return high
