"""``python -m benchmarks.time_to_quality``: calibrate, solve the link rate, train every method and
seed on the emulated cluster in one invocation, score BLEU, write the report; or ``--render`` a
report again from its JSON, or ``--predict-scale`` from the parity grid's runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cluster.linkprobe import probe
from benchmarks.cluster.netns import ClusterSpec, EmulatedCluster, missing_requirements
from benchmarks.machine import machine
from benchmarks.time_to_quality.curves import steady_ms_per_iter
from benchmarks.time_to_quality.launch import calibrate, train
from benchmarks.time_to_quality.methods import BASELINE, NODES, RANKS_PER_NODE, Job, about, run_order
from benchmarks.time_to_quality.rates import allreduce_comm_s, solve_rate_mbit
from benchmarks.time_to_quality.report import fmt, summary, write_report
from benchmarks.time_to_quality.settings import Settings, parse_args
from recipes.common.run import list_checkpoints
from recipes.translation import config
from recipes.translation.compare import bleu

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
    if any("seed" not in run for run in report["runs"].values()):
        parser.error(f"{args.json}: a report of the earlier one-seed format (runs not keyed METHOD/seedN)")
    for path in write_report(report, args.out_dir or args.json.parent):
        print(f"wrote {path}")
    return 0


def missing_decent_dp(settings: Settings) -> str | None:
    """Why the decent-dp method cannot run here (None when it can or is not asked for)."""
    if "decent-dp" in settings.methods and importlib.util.find_spec("decent_dp") is None:
        return (
            "decent-dp is not installed: pip install -e '.[bench]' (decent-dp 0.2.3, torch kept), or leave "
            "decent-dp out of --methods"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--render"]:
        return render(arguments[1:])
    if arguments[:1] == ["--predict-scale"]:
        from benchmarks.time_to_quality.scale import main as predict_scale

        return predict_scale(arguments[1:])
    settings = parse_args(arguments)
    reason = missing_requirements()
    if reason is not None:
        print(f"error: the emulated cluster {reason}", file=sys.stderr)
        return 2
    reason = missing_decent_dp(settings)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    started = time.monotonic()
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    logs = settings.work_dir / "logs"
    logs.mkdir(exist_ok=True)
    optim = config.load(settings.preset, settings.recipe_overrides()).optim  # the preset's rate, warm-up
    warmup = optim.warmup_steps

    logger.info("calibrating: %d ranks at once, no network", NODES * RANKS_PER_NODE)
    calibration = calibrate(settings, logs)
    compute_s, param_bytes = calibration["compute_s"], calibration["param_bytes"]
    logger.info("C = %.0f ms, S = %.1f MB", compute_s * 1e3, param_bytes / 1e6)
    if settings.link_mbit is not None:
        rate, how = settings.link_mbit, "--link-mbit"
    else:
        rate = solve_rate_mbit(compute_s, param_bytes, settings.comm_ratio)
        how = f"solved: DDP's communication = {settings.comm_ratio:g} x C"
    comm = allreduce_comm_s(rate, param_bytes)
    print(f"node link rate: {rate:g} Mbit/s ({how}; DDP communicates {comm / compute_s:.2f} x C)", flush=True)

    jobs = run_order(settings.methods, settings.seeds, settings.lrs or (optim.lr,))
    grid = len(settings.lrs) > 1
    trained: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {
        "command": shlex.join([*COMMAND, *arguments]),
        "preset": settings.preset,
        "data": settings.data,
        "overrides": list(settings.overrides),
        "steps": settings.steps,
        "max_steps": settings.step_cap,
        "time_budget": True,
        "eval_every": settings.eval_every,
        "seeds": list(settings.seeds),
        "lrs": list(settings.lrs or (optim.lr,)),
        "best": settings.best,
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "about": {name: about(name, settings.best, warmup) for name in settings.methods},
        "calibration": calibration,
        "link": {"rate_mbit": rate, "how": how, "allreduce_comm_s": comm, "comm_ratio": settings.comm_ratio},
    }
    with EmulatedCluster(ClusterSpec(nodes=NODES, rate_mbit=rate, prefix=settings.prefix)) as cluster:
        report["probes"] = {
            "duplex": probe(cluster, [(0, 1), (1, 0)], rate / 8 * 2.0),  # ~2 s: past TCP's slow start
            "intra": probe(cluster, [(n, n) for n in range(NODES) for _ in range(RANKS_PER_NODE)], 100.0),
        }
        report["model_inputs"] = {
            "inter_bytes_per_s": report["probes"]["duplex"]["bytes_per_s"],
            "intra_bytes_per_s": report["probes"]["intra"]["bytes_per_s"],
        }

        def run_one(job: Job, run: Path, budget: float | None) -> dict[str, Any]:
            return train(cluster, job, settings, run, logs, warmup, budget)

        def seed_done(seed: int) -> None:
            score(trained, seed, settings, calibration["test"])

        train_in_order(jobs, grid, settings, run_one, seed_done, trained)
    report["grid" if grid else "runs"] = trained
    if grid:
        report["runs"] = {}  # curves.analyse picks each method's rate
    report["elapsed_seconds"] = round(time.monotonic() - started, 1)
    report["machine"] = machine()
    paths = write_report(report, settings.out_dir)
    print(summary(report))
    for path in paths:
        print(f"wrote {path}")
    failed = [key for key, run in trained.items() if "failed" in run]
    if failed:
        print(f"error: {len(failed)} of {len(trained)} trainings failed ({', '.join(failed)}): see the "
              f"report's 'Failed trainings' and {logs}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def train_in_order(
    jobs: Sequence[Job],
    grid: bool,
    settings: Settings,
    run_one: Callable[[Job, Path, float | None], dict[str, Any]],
    seed_done: Callable[[int], None],
    trained: dict[str, dict[str, Any]],
) -> None:
    """Train ``jobs`` in their order into ``trained`` (by key): All-Reduce for ``settings.steps``
    steps, every other job for All-Reduce's training time with its seed and rate (``run_one``'s third
    argument; None, so ``settings.steps``, where that All-Reduce failed or is not run first); call
    ``seed_done`` once a seed's trainings are done."""
    budgets: dict[tuple[int, float], float] = {}  # All-Reduce's training seconds by (seed, rate)
    for order, job in enumerate(jobs, start=1):
        key = job.key(grid)
        run = settings.work_dir / key.replace("/", "-")
        budget = None if job.method == BASELINE else budgets.get((job.seed, job.lr))
        length = f"{settings.steps} steps" if budget is None else f"All-Reduce's {budget:.0f} s"
        logger.info("training %d/%d: %s, %s", order, len(jobs), key, length)
        result = run_one(job, run, budget)
        result.update(order=order, run_dir=str(run))
        trained[key] = result
        if job.method == BASELINE and "failed" not in result and result["curve"]:
            budgets[(job.seed, job.lr)] = result["curve"][-1]["train_seconds"]
        if "failed" in result:  # the others still run; the report says which failed and why
            logger.error("%s FAILED after %.0f s wall: %s", key, result["wall_seconds"],
                         result["failed"].splitlines()[0])  # fmt: skip
        else:
            logger.info("%s: %s ms per step, %.0f s wall", key,
                        fmt(steady_ms_per_iter(result["curve"])), result["wall_seconds"])  # fmt: skip
        if order == len(jobs) or jobs[order].seed != job.seed:  # the seed's trainings are done
            seed_done(job.seed)


def score(trained: dict[str, dict[str, Any]], seed: int, settings: Settings, test: dict[str, str]) -> None:
    """BLEU of each run of ``seed``: of its final checkpoint (``bleu``) and of its last one within
    DDP's training time with the same seed and rate (``bleu_in_allreduce_time``; with DDP failed, the
    final one's); then the run keeps only those two checkpoints. Failed runs are not scored."""
    runs = [r for r in trained.values() if r["seed"] == seed]
    for run in runs:
        if "failed" in run:
            continue  # its last checkpoint may be from before the failure, or none: not scored
        directory = Path(run["run_dir"])
        base = next((r for r in runs if r["method"] == BASELINE and r["lr"] == run["lr"]), None)
        if base is not None and "failed" not in base and base["curve"]:
            limit = base["curve"][-1]["train_seconds"]
        else:
            limit = float("inf")  # no DDP run of this seed finished: every checkpoint is within
        within = [p["step"] for p in run["curve"] if p["train_seconds"] <= limit]
        command, scores = _bleu(directory, settings, test)
        run.update(bleu_command=shlex.join(command), **scores)
        keep = {run["curve"][-1]["step"]}
        if run["curve"][-1]["train_seconds"] <= limit:
            run["bleu_in_allreduce_time"] = scores.get("bleu")
        elif within:
            keep.add(within[-1])
            later = [c for c in list_checkpoints(directory) if _step(c) > within[-1]]
            aside = [c.with_name(f".{c.name}.aside") for c in later]
            for source, target in zip(later, aside, strict=True):
                source.rename(target)  # the run directory's last checkpoint is now the one in DDP's time
            try:
                _, early = _bleu(directory, settings, test)
            finally:
                for source, target in zip(aside, later, strict=True):
                    source.rename(target)
            run["bleu_in_allreduce_time"] = early.get("bleu")
            run["bleu_in_allreduce_time_step"] = within[-1]
        else:
            run["bleu_in_allreduce_time"] = None  # not one evaluation within DDP's time
        for checkpoint in list_checkpoints(directory):
            if _step(checkpoint) not in keep:
                shutil.rmtree(checkpoint)


def _bleu(run: Path, settings: Settings, test: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    return bleu(run, settings.data, test["split"], test["src"], test["tgt"], list(settings.bleu_args))


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("-", 1)[1])
