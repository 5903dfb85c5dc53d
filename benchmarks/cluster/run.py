"""Emulated-cluster benchmark: All-Reduce vs DecentralizedAdam vs decent-dp, measured and predicted.

As root, from the repository root (the lock keeps other CPU-heavy jobs off the 2 cores)::

    flock /tmp/decentadam-cpu.lock .venv/bin/python -m benchmarks.cluster.run   # 4 x 2, 1 Gbit/s, ~12 min
    .venv/bin/python -m benchmarks.cluster.run --quick                            # 2 x 2, 25 MB, ~3 min

Steps: build the emulated cluster (``netns``), probe the links (``linkprobe``: TCP throughput
between nodes and inside a node, with the tbf byte counters showing which path was shaped), time
the optimizer steps with all ranks stepping at once (the runtime model's update-time inputs), run
every configuration (``cases``) as N x L ``worker`` processes in their node namespaces
(``launch``), tear the cluster down, and write ``benchmarks/results/cluster_{N}x{L}_{rate}.md`` /
``.png`` / ``.json`` (``report``) with the measurements next to decentadam.runtime_model's
predictions. The model gets only the probe and calibration numbers and the configured C and S:
nothing is fitted to the configurations it predicts. The decent-dp cases need the ``bench`` extra
(``pip install -e '.[bench]'``); ``--peer-topologies ''`` leaves them out.
"""

from __future__ import annotations

if not __package__:  # run as a file: the `benchmarks` package would not be importable
    raise SystemExit(
        f"{__file__} is a module of the benchmarks package: run python -m benchmarks.cluster.run "
        "from the repository root"
    )

import argparse
import importlib.util
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.cluster.cases import (
    BenchConfig,
    Outcome,
    case_spec,
    cases_of,
    predictions,
    run_mean,
    summarize,
)
from benchmarks.cluster.launch import REPO, rank_commands, run_all
from benchmarks.cluster.linkprobe import probe
from benchmarks.cluster.netns import ClusterSpec, EmulatedCluster, missing_requirements
from benchmarks.cluster.report import write_report
from benchmarks.machine import machine
from decentadam.runtime_model import Cluster, Workload, predict

logger = logging.getLogger("cluster-bench")

RESULTS = REPO / "benchmarks" / "results"
WORKER = "benchmarks.cluster.worker"


def launch(
    cluster: EmulatedCluster, config: BenchConfig, spec: dict[str, Any], logs: Path, name: str
) -> dict[str, Any]:
    """Run the worker on every rank in its node namespace; return rank 0's JSON result."""
    out = logs / f"{name}.json"
    argv = [sys.executable, "-m", WORKER, json.dumps({**spec, "out": str(out)})]
    commands = rank_commands(
        cluster, argv, config.ranks_per_node, logs, name, env={"LOGURU_LEVEL": "WARNING"}
    )
    run_all(commands, config.timeout_s, f"{spec['method']} {spec.get('topology', '')}".strip())
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def missing_decent_dp() -> str | None:
    """Why the decent-dp cases cannot run here (None when they can)."""
    if importlib.util.find_spec("decent_dp") is None:
        return (
            "decent-dp is not installed: pip install -e '.[bench]' (or --peer-topologies '' to leave "
            "decent-dp out)"
        )
    return None


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


def exchange_alone(
    cluster: EmulatedCluster, config: BenchConfig, base: dict[str, Any], model: Cluster, logs: Path
) -> dict[str, dict[str, float]]:
    """Each decentadam topology's exchanges with no compute and no update, measured and predicted.

    The model's prediction is the same recursion with C = 0 and U = 0: what it says the network
    alone costs per iteration. The gap to the measurement is the communicator's and the machine's
    own overhead, before any training work competes for the cores.
    """
    alone: dict[str, dict[str, float]] = {}
    for topology in config.topologies:
        logger.info("exchanges alone: %s", topology)
        spec = {**base, "method": "exchange", "topology": topology, "compute_ms": 0.0}
        raw = launch(cluster, config, spec, logs, f"exchange-{topology}")
        ranks = raw["ranks"]
        measured = run_mean(ranks, config.iters)
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    arguments = list(sys.argv[1:] if argv is None else argv)
    config, args = parse_args(arguments)
    command = shlex.join([".venv/bin/python", "-m", "benchmarks.cluster.run", *arguments])
    reason = missing_requirements() or (missing_decent_dp() if config.peer_topologies else None)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
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
        calibration_raw = launch(cluster, config, {**base, "method": "calibrate"}, logs, "calibrate")
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
                spec_of_case = case_spec(case, config, base)
                raw = launch(cluster, config, spec_of_case, logs, f"case{index}-run{repeat}")
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


if __name__ == "__main__":
    sys.exit(main())
