"""The runtime model's side of the benchmark: the node link rate that makes All-Reduce
communication-bound by a chosen ratio, and each method's predicted iteration from measured inputs."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from benchmarks.time_to_quality.methods import BUCKET_BYTES, NODES, RANKS_PER_NODE, Method
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
    target = ratio * compute_s
    low, high = 1e-3, 1e9  # Mbit/s
    if allreduce_comm_s(high, param_bytes, nodes, ranks_per_node) > target:
        raise ValueError(f"All-Reduce needs more than {target:g} s even at {high:g} Mbit/s")
    if allreduce_comm_s(low, param_bytes, nodes, ranks_per_node) < target:
        raise ValueError(f"All-Reduce needs less than {target:g} s even at {low:g} Mbit/s")
    for _ in range(200):
        middle = math.sqrt(low * high)
        if allreduce_comm_s(middle, param_bytes, nodes, ranks_per_node) > target:
            low = middle
        else:
            high = middle
        if high / low < 1 + 1e-9:
            break
    return float(f"{high:.3g}")


def predictions(method: Method, calibration: dict[str, Any], model_cluster: Cluster) -> dict[str, float]:
    """The runtime model's iteration times (ms) for one method, from the measured inputs only:
    overlapped (as for a real cluster), serialized (updates and exchanges taking turns on the shared
    cores), the lower bound with free optimizer steps, the communication and the inter-node MB."""
    work = Workload(
        param_bytes=calibration["param_bytes"],
        compute_s=calibration["compute_s"],
        forward_fraction=calibration["forward_fraction"],
        update_s=calibration["decentralized_s"],
        allreduce_update_s=calibration["adamw_s"],
        bucket_bytes=BUCKET_BYTES,
        hierarchical=True,  # DecentralizedAdam on gloo sums multi-node groups in three phases
        update_values=calibration["params"] if method.bf16_updates else 0.0,
        moment_values=calibration["params"] if method.share_every else 0.0,
        share_every=method.share_every or 2,
        **method.workload,
    )
    overlapped = predict(method.model, model_cluster, work)
    serial = predict(method.model, model_cluster, replace(work, update_overlaps_comm=False))
    return {
        "iteration_ms": overlapped.iteration_s * 1e3,
        "serial_ms": serial.iteration_s * 1e3,
        "lower_bound_ms": overlapped.lower_bound_s * 1e3,
        "comm_ms": overlapped.comm_s * 1e3,
        "inter_mb": overlapped.inter_bytes_per_rank / 1e6,
    }
