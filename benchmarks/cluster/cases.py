"""What the cluster benchmark runs and what it makes of the ranks' timings: its settings, the cases
(configurations), each case's worker spec and runtime-model predictions, and the summary of its runs."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from decentadam.runtime_model import ALLREDUCE, Cluster, Prediction, Workload, predict

PEER_TOPOLOGY = {
    "complete": "complete",
    "ring": "ring",
    "one-peer-exp": "one-peer-exp",
    "aer": "alternating-exp-ring",
}
"""decent-dp's name for each topology."""

H100_UPDATE_MS_PER_MB = 2.7 / 206.7
"""AccumAdamW(accum_steps=4, foreach) on an H100: 2.7 ms for 51.7M float32 parameters (206.7 MB),
measured with ``python benchmarks/optimizer_step.py --device cuda``
(benchmarks/results/optimizer_step_cuda.md)."""


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one benchmark run."""

    nodes: int = 4
    """N node namespaces."""
    ranks_per_node: int = 2
    """L ranks per node."""
    rate_mbit: float = 1000.0
    """Node link rate per direction."""
    param_mb: float = 100.0
    """S in MB (10^6 bytes)."""
    compute_ms: float = 100.0
    """C: emulated forward + backward per rank."""
    layers: int = 8
    warmup: int = 4
    iters: int = 12
    """Measured iterations (a multiple of every period: 2, 3, 4)."""
    repeats: int = 1
    """Runs of every configuration, one round of all of them after another (drifts hit all alike)."""
    straggler_factor: float = 2.0
    bucket_mb: float = 25.0
    topologies: tuple[str, ...] = ("complete", "ring", "one-peer-exp", "aer")
    peer_topologies: tuple[str, ...] = ("one-peer-exp", "aer")
    """Topologies also run with decent-dp (empty: skip decent-dp)."""
    stragglers: bool = True
    timeout_s: float = 300.0
    update_ms_per_mb: float = H100_UPDATE_MS_PER_MB
    """Optimizer arithmetic emulated at this many ms per MB of parameters (0: real, on the CPU)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def straggler_rank(self) -> int:
        return min(3, self.world_size - 1)  # node 1's second rank (or the last)

    @property
    def name(self) -> str:
        rate = f"{self.rate_mbit / 1000:g}gbit" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g}mbit"
        updates = "" if self.update_ms_per_mb > 0 else "_cpu-updates"
        return f"cluster_{self.nodes}x{self.ranks_per_node}_{rate}{updates}"


@dataclass(frozen=True)
class Case:
    """One configuration to run."""

    library: str  # "torch DDP" | "decentadam" | "decent-dp"
    method: str  # worker method
    topology: str  # runtime-model name: all-reduce | complete | ring | one-peer-exp | aer
    straggler: bool = False
    overlap: str = "step"
    """decentadam: Comm(overlap=...); "backward" updates from hooks, as decent-dp does."""
    hierarchical: bool = True
    """decentadam: multi-node groups summed hierarchically (default) or by one flat ring."""

    @property
    def label(self) -> str:
        what = "All-Reduce" if self.topology == ALLREDUCE else self.topology
        hooks = " (backward hooks)" if self.overlap == "backward" else ""
        flat = " (flat rings)" if self.library == "decentadam" and not self.hierarchical else ""
        return f"{self.library} {what}{hooks}{flat}" + (" +straggler" if self.straggler else "")


@dataclass
class Outcome:
    """Measured and predicted numbers of one case."""

    case: Case
    mean_ms: float
    median_ms: float
    p90_ms: float
    wait_ms: float
    update_ms: float
    inter_mb_per_rank: float
    buffer_mb_per_rank: float | None
    predicted_ms: float
    """The model as for a real cluster: updates overlap the exchanges (update_overlaps_comm=True)."""
    predicted_serial_ms: float
    """The model with updates and exchanges taking turns on the shared cores (False)."""
    lower_bound_ms: float
    predicted_inter_mb: float
    cpu_busy: float | None = None
    """Share of the machine's cores busy during the measured iterations (mean over runs)."""
    run_means_ms: list[float] = field(default_factory=list)
    """mean ms per iteration of each repeat, in the order they ran (mean_ms is their mean)."""
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def error(self) -> float:
        return self.predicted_ms / self.mean_ms - 1.0

    @property
    def serial_error(self) -> float:
        return self.predicted_serial_ms / self.mean_ms - 1.0

    @property
    def band_error(self) -> float:
        """0 inside [overlapped, serialized], else the relative distance to the nearer end."""
        low, high = sorted((self.predicted_ms, self.predicted_serial_ms))
        if low <= self.mean_ms <= high:
            return 0.0
        nearer = low if self.mean_ms < low else high
        return nearer / self.mean_ms - 1.0


def cases_of(config: BenchConfig) -> list[Case]:
    """Every configuration ``config`` asks for, All-Reduce first, the straggler cases last."""
    cases = []
    for straggler in (False, True) if config.stragglers else (False,):
        cases.append(Case("torch DDP", "allreduce", ALLREDUCE, straggler))
        cases.extend(Case("decentadam", "ours", t, straggler) for t in config.topologies)
        if "aer" in config.topologies:
            cases.append(Case("decentadam", "ours", "aer", straggler, overlap="backward"))
            if not straggler:  # the same run's A/B of the hierarchical group sums
                cases.append(Case("decentadam", "ours", "aer", straggler, hierarchical=False))
        if not straggler or "aer" in config.peer_topologies:
            peers = config.peer_topologies if not straggler else ("aer",)
            cases.extend(Case("decent-dp", "decent-dp", t, straggler) for t in peers)
    return cases


def case_spec(case: Case, config: BenchConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The worker's JSON spec for one case."""
    spec: dict[str, Any] = {**base, "method": case.method}
    if case.method == "ours":
        spec["topology"] = case.topology
        spec["overlap"] = case.overlap
        spec["hierarchical"] = case.hierarchical
    elif case.method == "decent-dp":
        spec["topology"] = PEER_TOPOLOGY[case.topology]
    if case.straggler:
        spec |= {"straggler_rank": config.straggler_rank, "straggler_factor": config.straggler_factor}
    return spec


def predictions(
    case: Case, config: BenchConfig, calibration: dict[str, float], cluster: Cluster
) -> tuple[Prediction, Prediction]:
    """The runtime model's (overlapped, serialized) predictions for one case, from measured inputs only."""
    update = {
        "torch DDP": calibration["adamw_s"],
        "decentadam": calibration["ours_update_s"],
        "decent-dp": calibration.get("decent_dp_update_s", calibration["ours_update_s"]),
    }[case.library]
    scale = tuple(
        config.straggler_factor if case.straggler and r == config.straggler_rank else 1.0
        for r in range(config.world_size)
    )
    workload = Workload(
        param_bytes=config.param_mb * 1e6,
        compute_s=config.compute_ms / 1e3,
        update_s=update,
        allreduce_update_s=update,
        bucket_bytes=config.bucket_mb * 2**20,
        overlap="backward" if case.library == "decent-dp" else case.overlap,  # decent-dp: hooks
        compute_scale=scale,
        hierarchical=case.library == "decentadam" and case.hierarchical,  # decent-dp: flat rings
    )
    predicted = predict(case.topology, cluster, workload)
    serial = predict(case.topology, cluster, replace(workload, update_overlaps_comm=False))
    return predicted, serial


def summarize(
    case: Case,
    raws: list[dict[str, Any]],
    config: BenchConfig,
    predicted: Prediction,
    serial: Prediction,
) -> Outcome:
    """One case's numbers over its repeats: the mean of the repeats' means, percentiles pooled."""
    iters = config.iters
    runs = [raw["ranks"] for raw in raws]
    ranks = [r for run in runs for r in run]
    deltas = [b - a for r in ranks for a, b in itertools.pairwise([r["start"], *r["ends"]])]
    run_means = [run_mean(run, iters) for run in runs]
    link = [r["link_bytes_out"] for r in ranks if r["link_bytes_out"] >= 0]
    buffer = [r["bytes_sent"] for r in ranks]
    busy = [r["cpu_busy"] for r in ranks if r["cpu_busy"] >= 0]  # rank 0's reading
    return Outcome(
        case=case,
        mean_ms=statistics.mean(run_means) * 1e3,
        median_ms=statistics.median(deltas) * 1e3,
        p90_ms=_quantile(deltas, 0.9) * 1e3,
        wait_ms=statistics.mean(w for r in ranks for w in r["wait_s"]) * 1e3,
        update_ms=statistics.mean(u for r in ranks for u in r["update_s"]) * 1e3,
        inter_mb_per_rank=sum(link) / (config.world_size * iters * len(raws)) / 1e6,
        buffer_mb_per_rank=statistics.mean(buffer) / iters / 1e6 if case.library == "decentadam" else None,
        predicted_ms=predicted.iteration_s * 1e3,
        predicted_serial_ms=serial.iteration_s * 1e3,
        lower_bound_ms=predicted.lower_bound_s * 1e3,
        predicted_inter_mb=predicted.inter_bytes_per_rank / 1e6,
        cpu_busy=statistics.mean(busy) if busy else None,
        run_means_ms=[m * 1e3 for m in run_means],
        raw={"runs": runs},
    )


def run_mean(ranks: list[dict[str, Any]], iters: int) -> float:
    """Seconds per iteration of one run: (end of last - start) / iterations, averaged over ranks."""
    return statistics.mean(float(r["ends"][-1] - r["start"]) / iters for r in ranks)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
