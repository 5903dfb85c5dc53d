"""``python -m benchmarks.time_to_quality``: calibrate, solve the link rate, train every method on the
emulated cluster, score BLEU, write the report; or ``--render`` a report again from its JSON."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.cluster.linkprobe import probe
from benchmarks.cluster.netns import ClusterSpec, EmulatedCluster, missing_requirements
from benchmarks.machine import machine
from benchmarks.time_to_quality.curves import comm_wait_ms, steady_ms_per_iter
from benchmarks.time_to_quality.launch import calibrate, train
from benchmarks.time_to_quality.methods import BASELINE, METHODS, NODES, RANKS_PER_NODE
from benchmarks.time_to_quality.rates import allreduce_comm_s, predictions, solve_rate_mbit
from benchmarks.time_to_quality.report import fmt, summary, write_report
from benchmarks.time_to_quality.settings import parse_args
from decentadam.runtime_model import Cluster
from recipes.translation.compare import bleu, curve

logger = logging.getLogger("time-to-quality")

COMMAND = (".venv/bin/python", "-m", "benchmarks.time_to_quality")
"""How the report shows the command that made it."""


def render(argv: Sequence[str]) -> int:
    """``--render JSON [--out-dir DIR]``: write the report again from a run's JSON (numbers unchanged;
    the text and the plot as the current code writes them)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality --render")
    parser.add_argument("json", type=Path, help="a run's time_to_quality.json")
    parser.add_argument("--out-dir", type=Path, help="report directory (default: the JSON's)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as error:
        parser.error(f"{args.json}: cannot read the run's JSON ({error})")
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict):
        parser.error(f"{args.json}: not a time_to_quality.json (no 'runs')")
    for path in write_report(report, args.out_dir or args.json.parent):
        print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--render"]:
        return render(arguments[1:])
    settings = parse_args(arguments)
    reason = missing_requirements()
    if reason is not None:
        print(f"error: the emulated cluster {reason}", file=sys.stderr)
        return 2
    command = shlex.join([*COMMAND, *arguments])
    started = time.monotonic()
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    logs = settings.work_dir / "logs"
    logs.mkdir(exist_ok=True)

    logger.info("calibrating: %d ranks at once, no network", NODES * RANKS_PER_NODE)
    calibration = calibrate(settings, logs)
    compute_s, param_bytes = calibration["compute_s"], calibration["param_bytes"]
    logger.info(
        "C = %.0f ms (mean rank %.0f ms, forward %.0f%%), S = %.1f MB, AdamW %.0f ms, "
        "DecentralizedAdam %.0f ms",
        compute_s * 1e3,
        calibration["compute_mean_s"] * 1e3,
        calibration["forward_fraction"] * 100,
        param_bytes / 1e6,
        calibration["adamw_s"] * 1e3,
        calibration["decentralized_s"] * 1e3,
    )
    if settings.link_mbit is not None:
        rate, how = settings.link_mbit, settings.link_how
    else:
        rate = solve_rate_mbit(compute_s, param_bytes, settings.comm_ratio)
        how = f"solved: All-Reduce communication = {settings.comm_ratio:g} x C"
    comm = allreduce_comm_s(rate, param_bytes)
    print(
        f"node link rate: {rate:g} Mbit/s ({how}; All-Reduce communicates {comm * 1e3:.0f} ms per "
        f"iteration = {comm / compute_s:.2f} x C)",
        flush=True,
    )

    report: dict[str, Any] = {
        "command": command,
        "preset": settings.preset,
        "data": settings.data,
        "overrides": list(settings.overrides),
        "steps": settings.steps,
        "eval_every": settings.eval_every,
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "calibration": calibration,
        "link": {"rate_mbit": rate, "how": how, "allreduce_comm_s": comm, "comm_ratio": settings.comm_ratio},
        "runs": {} if settings.baseline is None else {BASELINE: settings.baseline},
    }
    with EmulatedCluster(ClusterSpec(nodes=NODES, rate_mbit=rate, prefix=settings.prefix)) as cluster:
        probes = {
            "duplex": probe(cluster, [(0, 1), (1, 0)], rate / 8 * 2.0),  # ~2 s: past TCP's slow start
            "intra": probe(cluster, [(n, n) for n in range(NODES) for _ in range(RANKS_PER_NODE)], 100.0),
        }
        for name, p in probes.items():
            logger.info("%s: %.1f MB/s, %d bytes through tbf", name, p["bytes_per_s"] / 1e6, p["tbf_bytes"])
        model_cluster = Cluster(
            NODES,
            RANKS_PER_NODE,
            inter_bytes_per_s=probes["duplex"]["bytes_per_s"],
            intra_bytes_per_s=probes["intra"]["bytes_per_s"],
        )
        report["probes"] = probes
        report["model_inputs"] = {
            "inter_bytes_per_s": model_cluster.inter_bytes_per_s,
            "intra_bytes_per_s": model_cluster.intra_bytes_per_s,
        }
        for name in settings.methods:
            method = METHODS[name]
            predicted = predictions(method, calibration, model_cluster)
            logger.info(
                "training %s: %d steps (predicted %.0f ms per step)", method.label, settings.steps,
                predicted["iteration_ms"],
            )  # fmt: skip
            run = settings.work_dir / name
            result = train(cluster, method, settings, run, logs)
            result["predicted"] = predicted
            result["curve"] = curve(run)
            result["comm_wait_ms"] = comm_wait_ms(run)
            report["runs"][name] = result
            ms = steady_ms_per_iter(result["curve"])
            logger.info("%s: %s ms per step, %.0f s wall", method.label, fmt(ms), result["wall_seconds"])

    for name, result in report["runs"].items():
        if result.get("from"):
            continue  # scored in its own run
        test = calibration["test"]  # the preset's test split and languages, as the recipe read them
        bleu_command, scores = bleu(
            settings.work_dir / name, settings.data, test["split"], test["src"], test["tgt"],
            list(settings.bleu_args),
        )  # fmt: skip
        result["bleu_command"] = shlex.join(bleu_command)
        result.update(scores)
    report["elapsed_seconds"] = round(time.monotonic() - started, 1)
    report["machine"] = machine()
    paths = write_report(report, settings.out_dir)
    print(summary(report))
    for path in paths:
        print(f"wrote {path}")
    return 0
