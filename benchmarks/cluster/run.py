"""Emulated-cluster benchmark: All-Reduce vs DecentralizedAdam vs decent-dp, measured and predicted.

As root, from the repository root (the lock keeps other CPU-heavy jobs off the 2 cores)::

    flock /tmp/decentadam-cpu.lock .venv/bin/python benchmarks/cluster/run.py   # 4 x 2, 1 Gbit/s, ~12 min
    .venv/bin/python benchmarks/cluster/run.py --quick                            # 2 x 2, 25 MB, ~3 min

Steps: build the emulated cluster (benchmarks/cluster/netns.py), probe the links (TCP throughput
between nodes and inside a node, with the tbf byte counters showing which path was shaped), time
the optimizer steps with all ranks stepping at once (the runtime model's update-time inputs), run
every configuration as N x L processes in their node namespaces (worker.py), tear the cluster down,
and write ``benchmarks/results/cluster_{N}x{L}_{rate}.md`` / ``.png`` / ``.json`` with the
measurements next to decentadam.runtime_model's predictions. The model gets only the probe and
calibration numbers and the configured C and S: nothing is fitted to the configurations it predicts.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from netns import ClusterSpec, EmulatedCluster  # noqa: E402

from decentadam.runtime_model import ALLREDUCE, Cluster, Workload, predict  # noqa: E402

logger = logging.getLogger("cluster-bench")

RESULTS = REPO / "benchmarks" / "results"
WORKER = Path(__file__).resolve().parent / "worker.py"
PROBE = Path(__file__).resolve().parent / "linkprobe.py"
DECENT_DP = "decent-dp==0.2.3"
PEER_TOPOLOGY = {
    "complete": "complete",
    "ring": "ring",
    "one-peer-exp": "one-peer-exp",
    "aer": "alternating-exp-ring",
}


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
    """decentadam: DecentralizedAdam(overlap=...); "backward" updates from hooks, as decent-dp does."""
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


# ------------------------------------------------------------------------------------ processes


def launch(
    cluster: EmulatedCluster, config: BenchConfig, spec: dict[str, Any], port: int, logs: Path
) -> dict[str, Any]:
    """Run worker.py on every rank in its node namespace; return rank 0's JSON result."""
    out = logs / f"result_{port}.json"
    spec = {**spec, "out": str(out)}
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(config.world_size):
            node, local = divmod(rank, config.ranks_per_node)
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(config.world_size),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(config.ranks_per_node),
                "MASTER_ADDR": cluster.spec.address(0),
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "eth0",  # bind to this node's address; same-node peers go over lo
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO),
                "LOGURU_LEVEL": "WARNING",
            }
            log = logs / f"rank{rank}_{port}.log"
            argv = [*cluster.exec_prefix(node), sys.executable, str(WORKER), json.dumps(spec)]
            with open(log, "wb") as sink:
                proc = subprocess.Popen(
                    argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                )
            procs.append((proc, log))
        deadline = time.monotonic() + config.timeout_s
        while any(proc.poll() is None for proc, _ in procs):
            failed = [(proc, log) for proc, log in procs if proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                proc, log = failed[0] if failed else procs[0]
                why = (
                    f"exited with {proc.returncode}" if failed else f"timed out after {config.timeout_s:g} s"
                )
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{spec['method']} {spec.get('topology')}: a rank {why}; its log ({log}):\n{tail}"
                )
            time.sleep(0.2)
        bad = [(proc, log) for proc, log in procs if proc.returncode != 0]
        if bad:
            tail = bad[0][1].read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{spec['method']}: a rank exited with {bad[0][0].returncode}:\n{tail}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        for proc, _ in procs:  # only the processes started here, each by its own session id
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def probe(cluster: EmulatedCluster, streams: list[tuple[int, int]], megabytes: float) -> dict[str, Any]:
    """Concurrent TCP streams (client node -> server node's address): mean per-stream rate, tbf bytes."""
    before = cluster.link_bytes()
    servers: list[subprocess.Popen[str]] = []
    try:
        for index, (_, server_node) in enumerate(streams):
            host = cluster.spec.address(server_node)
            argv = [sys.executable, str(PROBE), "serve", host, str(5600 + index)]
            server = subprocess.Popen(
                [*cluster.exec_prefix(server_node), *argv], stdout=subprocess.PIPE, text=True
            )
            servers.append(server)
            assert server.stdout is not None
            server.stdout.readline()  # "ready"
        clients = [
            subprocess.Popen(
                [
                    *cluster.exec_prefix(client_node),
                    sys.executable,
                    str(PROBE),
                    "send",
                    cluster.spec.address(server_node),
                    str(5600 + index),
                    str(megabytes),
                ],
                stdout=subprocess.DEVNULL,
            )
            for index, (client_node, server_node) in enumerate(streams)
        ]
        for client in clients:
            if client.wait(timeout=120) != 0:
                raise RuntimeError(f"link probe client exited with {client.returncode}")
        results = [json.loads(server.communicate(timeout=60)[0]) for server in servers]
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait()
    after = cluster.link_bytes()
    return {
        "streams": len(streams),
        "bytes": sum(r["bytes"] for r in results),
        "bytes_per_s": statistics.mean(r["bytes_per_s"] for r in results),
        "tbf_bytes": sum(a[0] - b[0] + a[1] - b[1] for a, b in zip(after, before, strict=True)),
    }


def ensure_decent_dp() -> None:
    """Install decent-dp (and its one pure-Python dependency, loguru) without letting pip touch torch."""
    check = subprocess.run([sys.executable, "-c", "import decent_dp.ddp"], capture_output=True)
    if check.returncode == 0:
        return
    logger.info("installing %s with --no-deps (torch stays as it is)", DECENT_DP)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*pip, DECENT_DP, "loguru>=0.7.3"], check=True)


# ------------------------------------------------------------------------------------ analysis


def summarize(
    case: Case, raws: list[dict[str, Any]], config: BenchConfig, predicted: Any, serial: Any
) -> Outcome:
    """One case's numbers over its repeats: the mean of the repeats' means, percentiles pooled."""
    iters = config.iters
    runs = [raw["ranks"] for raw in raws]
    ranks = [r for run in runs for r in run]
    deltas = [b - a for r in ranks for a, b in itertools.pairwise([r["start"], *r["ends"]])]
    run_means = [_run_mean(run, iters) for run in runs]
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


def _run_mean(ranks: list[dict[str, Any]], iters: int) -> float:
    """Seconds per iteration of one run: (end of last - start) / iterations, averaged over ranks."""
    return statistics.mean(float(r["ends"][-1] - r["start"]) / iters for r in ranks)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 x 2 nodes, 25 MB, few iterations, no stragglers"
    )
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--ranks-per-node", type=int)
    parser.add_argument("--rate-mbit", type=float)
    parser.add_argument("--param-mb", type=float)
    parser.add_argument("--compute-ms", type=float)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument(
        "--repeats", type=int, help="run every configuration this many times, interleaved (default 1)"
    )
    parser.add_argument("--topologies", help="comma-separated decentadam topologies")
    parser.add_argument("--peer-topologies", help="comma-separated topologies for decent-dp ('' to skip it)")
    parser.add_argument("--no-stragglers", action="store_true")
    parser.add_argument(
        "--cpu-updates",
        action="store_true",
        help="run the optimizer arithmetic for real on the CPU (default: emulate an H100's update time)",
    )
    parser.add_argument("--prefix", default="dcab", help="namespace name prefix")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = BenchConfig()
    if args.quick:
        config = replace(config, nodes=2, param_mb=25.0, warmup=3, iters=6, stragglers=False)
    overrides: dict[str, Any] = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "rate_mbit": args.rate_mbit,
        "param_mb": args.param_mb,
        "compute_ms": args.compute_ms,
        "iters": args.iters,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if args.topologies is not None:
        config = replace(config, topologies=tuple(t for t in args.topologies.split(",") if t))
    if args.peer_topologies is not None:
        config = replace(config, peer_topologies=tuple(t for t in args.peer_topologies.split(",") if t))
    if args.no_stragglers:
        config = replace(config, stragglers=False)
    if args.cpu_updates:
        config = replace(config, update_ms_per_mb=0.0)
    if config.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {config.repeats}")
    return config, args


def cases_of(config: BenchConfig) -> list[Case]:
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


def exchange_alone(
    cluster: EmulatedCluster, config: BenchConfig, base: dict[str, Any], model: Cluster, logs: Path
) -> dict[str, dict[str, float]]:
    """Each decentadam topology's exchanges with no compute and no update, measured and predicted.

    The model's prediction is the same recursion with C = 0 and U = 0: what it says the network
    alone costs per iteration. The gap to the measurement is the communicator's and the machine's
    own overhead, before any training work competes for the cores.
    """
    alone: dict[str, dict[str, float]] = {}
    for index, topology in enumerate(config.topologies):
        logger.info("exchanges alone: %s", topology)
        spec = {**base, "method": "exchange", "topology": topology, "compute_ms": 0.0}
        raw = launch(cluster, config, spec, 29450 + index, logs)
        ranks = raw["ranks"]
        measured = _run_mean(ranks, config.iters)
        work = Workload(
            param_bytes=config.param_mb * 1e6,
            compute_s=0.0,
            bucket_bytes=config.bucket_mb * 2**20,
            hierarchical=True,
        )
        predicted = predict(topology, model, work)
        alone[topology] = {
            "measured_ms": measured * 1e3,
            "predicted_ms": predicted.iteration_s * 1e3,
            "cpu_busy": ranks[0]["cpu_busy"],
        }
        logger.info(
            "%s alone: %.0f ms per step, predicted %.0f, CPU %.0f%% busy",
            topology,
            alone[topology]["measured_ms"],
            alone[topology]["predicted_ms"],
            ranks[0]["cpu_busy"] * 100,
        )
    return alone


def predictions(
    case: Case, config: BenchConfig, calibration: dict[str, float], cluster: Cluster
) -> tuple[Any, Any]:
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    config, args = parse_args(argv)
    command = " ".join(
        shlex.quote(a) for a in [".venv/bin/python", "benchmarks/cluster/run.py", *sys.argv[1:]]
    )
    if config.peer_topologies:
        ensure_decent_dp()
    base = {
        "param_bytes": int(config.param_mb * 1e6),
        "layers": config.layers,
        "compute_ms": config.compute_ms,
        "warmup": config.warmup,
        "iters": config.iters,
        "bucket_mb": config.bucket_mb,
        "update_ms_per_mb": config.update_ms_per_mb,
    }
    started = time.monotonic()
    outcomes: list[Outcome] = []
    spec = ClusterSpec(nodes=config.nodes, rate_mbit=config.rate_mbit, prefix=args.prefix)
    with tempfile.TemporaryDirectory(prefix="decentadam-cluster-") as tmp, EmulatedCluster(spec) as cluster:
        logs = Path(tmp)
        logger.info("probing links")
        probes = {
            # one stream over one node link, ~0.5 s of traffic
            "inter": probe(cluster, [(0, 1)], config.rate_mbit / 8 * 0.5),
            # one stream each way over the same link: data and the other stream's ACKs share each
            # direction, as in every collective here (rings and rails send both ways at once)
            "duplex": probe(cluster, [(0, 1), (1, 0)], config.rate_mbit / 8 * 0.5),
            # every node at once, L streams each on its loopback (the ring edges of a node's ranks):
            # the emulated nodes share this machine's cores, as the ranks' intra-node exchanges do
            "intra": probe(
                cluster, [(n, n) for n in range(config.nodes) for _ in range(config.ranks_per_node)], 200.0
            ),
        }
        for name, p in probes.items():
            logger.info("%s: %.1f MB/s, %d bytes through tbf", name, p["bytes_per_s"] / 1e6, p["tbf_bytes"])
        logger.info("calibrating optimizer steps (all %d ranks at once)", config.world_size)
        calibration_raw = launch(cluster, config, {**base, "method": "calibrate"}, 29400, logs)
        calibration = {
            key: statistics.mean(r["calibration"][key] for r in calibration_raw["ranks"])
            for key in calibration_raw["ranks"][0]["calibration"]
        }
        logger.info("calibration: %s", {k: f"{v * 1e3:.0f} ms" for k, v in calibration.items()})
        # B_intra from gloo's own intra-node all-reduce (ring over L ranks: 2 (L-1)/L S per edge)
        if "intra_allreduce_s" in calibration:
            ring_bytes = 2 * (config.ranks_per_node - 1) / config.ranks_per_node * config.param_mb * 1e6
            intra_bytes_per_s = ring_bytes / calibration["intra_allreduce_s"]
        else:
            intra_bytes_per_s = probes["intra"]["bytes_per_s"]
        calibration_inputs = {"intra_bytes_per_s": intra_bytes_per_s}
        model_cluster = Cluster(
            nodes=config.nodes,
            ranks_per_node=config.ranks_per_node,
            inter_bytes_per_s=probes["duplex"]["bytes_per_s"],
            intra_bytes_per_s=intra_bytes_per_s,
        )
        alone = exchange_alone(cluster, config, base, model_cluster, logs)
        cases = cases_of(config)
        models = [predictions(case, config, calibration, model_cluster) for case in cases]
        runs: list[list[dict[str, Any]]] = [[] for _ in cases]
        for repeat in range(config.repeats):
            for index, case in enumerate(cases):
                logger.info("running %s (run %d of %d)", case.label, repeat + 1, config.repeats)
                port = 29500 + repeat * len(cases) + index
                raw = launch(cluster, config, case_spec(case, config, base), port, logs)
                runs[index].append(raw)
                mean = summarize(case, [raw], config, *models[index])
                logger.info(
                    "%s: mean %.0f ms, median %.0f, p90 %.0f, wait %.0f, update %.0f, "
                    "predicted %.0f (%+.0f%%) .. %.0f (%+.0f%%)",
                    case.label,
                    mean.mean_ms,
                    mean.median_ms,
                    mean.p90_ms,
                    mean.wait_ms,
                    mean.update_ms,
                    mean.predicted_ms,
                    mean.error * 100,
                    mean.predicted_serial_ms,
                    mean.serial_error * 100,
                )
        for case, raws, model in zip(cases, runs, models, strict=True):
            outcomes.append(summarize(case, raws, config, *model))
    elapsed = time.monotonic() - started
    from report import write_report

    paths = write_report(
        args.out_dir,
        config,
        command,
        probes,
        calibration | calibration_inputs,
        outcomes,
        elapsed,
        machine(),
        spec_summary=asdict(spec),
        alone=alone,
    )
    for path in paths:
        print(f"wrote {path}")
    return 0


def machine() -> dict[str, str]:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):  # not Linux, or no model name: keep the above
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


if __name__ == "__main__":
    sys.exit(main())
