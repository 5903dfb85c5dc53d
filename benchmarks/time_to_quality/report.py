"""The benchmark's report: ``time_to_quality.{md,json,png}`` from a run's measurements (analysed by
``curves``, explained by ``notes``), and the terminal summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.time_to_quality.curves import analyse
from benchmarks.time_to_quality.methods import BASELINE, NODES, RANKS_PER_NODE, label
from benchmarks.time_to_quality.notes import slower_notes
from benchmarks.time_to_quality.rates import allreduce_comm_s
from recipes.translation.compare import plot_curves

STEM = "time_to_quality"


def fmt(value: float | None, spec: str = ".0f", missing: str = "-") -> str:
    """``value`` formatted, or ``missing`` when there is none."""
    return missing if value is None else format(value, spec)


def _mean_and_seeds(field: dict[str, Any], spec: str, missing: str = "-") -> str:
    """``mean (seed values)`` of one of ``curves.summarize``'s fields."""
    seeds = "; ".join(fmt(v, spec, missing) for v in field["by_seed"])
    return f"{fmt(field['mean'], spec, missing)} ({seeds})"


def length(report: dict[str, Any]) -> str:
    """How long the trainings were: the same steps for every method (reports before the time budget),
    or All-Reduce's steps and every other method for All-Reduce's training time of its seed."""
    if not report.get("time_budget"):
        return f"{report['steps']} steps per training"
    return (
        f"DDP (float32) trains {report['steps']} steps; every other method trains for DDP's training time "
        f"of its seed (checked at each evaluation, so it may pass it by up to one interval; at most "
        f"{report['max_steps']} steps)"
    )


def markdown(report: dict[str, Any]) -> str:
    """The report's text (after :func:`~benchmarks.time_to_quality.curves.analyse`)."""
    cal, link, machine = report["calibration"], report["link"], report["machine"]
    compute_ms = cal["compute_s"] * 1e3
    probed_comm = allreduce_comm_s(report["model_inputs"]["inter_bytes_per_s"] * 8 / 1e6, cal["param_bytes"])
    seeds = sorted({run["seed"] for run in report["runs"].values()})
    lines = [
        "# Time to the same translation quality on a slow network: DecentralizedAdam against DDP and "
        "what a user would pick instead",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"Preset `{report['preset']}` with "
        + (f"`{' '.join(report['overrides'])}`, " if report["overrides"] else "no overrides, ")
        + length(report)
        + f", validation loss every {report['eval_every']} steps, "
        f"{NODES} emulated nodes x {RANKS_PER_NODE} ranks (benchmarks/cluster/netns.py), seeds "
        f"{', '.join(map(str, seeds))} (initial weights and data order; every method trains each), all "
        f"in this one invocation on one link rate. Machine: {machine.get('cpu', '?')}, "
        f"{machine.get('cores', '?')} cores, torch {machine.get('torch', '?')}, {machine.get('date', '?')}.",
        "",
        "## Methods",
        "",
        *[f"- `{name}`: {about}" for name, about in report["about"].items()],
        "",
        "## Inputs, measured before the runs",
        "",
        "| input | value |",
        "|---|---|",
        f"| C: forward + backward per iteration, 4 ranks at once (slowest rank per step; mean rank) "
        f"| {compute_ms:.0f} ms; {cal['compute_mean_s'] * 1e3:.0f} ms |",
        f"| S: parameter bytes | {cal['param_bytes'] / 1e6:.1f} MB ({cal['params'] / 1e6:.2f}M float32) |",
        f"| node link rate (tbf, per direction) | {link['rate_mbit']:g} Mbit/s ({link['how']}) |",
        f"| DDP's communication per iteration at that rate (runtime model) "
        f"| {link['allreduce_comm_s'] * 1e3:.0f} ms = "
        f"{link['allreduce_comm_s'] / cal['compute_s']:.2f} x C |",
        f"| B_inter: TCP, one stream each way over a node link "
        f"| {report['model_inputs']['inter_bytes_per_s'] / 1e6:.1f} MB/s |",
        f"| DDP's communication per iteration with the probed B_inter (runtime model) "
        f"| {probed_comm * 1e3:.0f} ms = {probed_comm / cal['compute_s']:.2f} x C |",
        "",
        *results_table(report),
        *failed_section(report),
        *goals_section(report),
        *order_table(report),
    ]
    for seed in seeds:
        lines += [f"## Validation loss at each evaluation, seed {seed}", ""]
        lines += curve_table({k: r for k, r in report["runs"].items() if r["seed"] == seed})
        lines.append("")
    lines += ["Plot: `time_to_quality.png`; every number above: `time_to_quality.json`.", ""]
    return "\n".join(lines)


def results_table(report: dict[str, Any]) -> list[str]:
    """Per method: time to DDP's final loss and its factors, the loss, BLEU and bytes, mean (seeds)."""
    lines = [
        "## Results",
        "",
        "Target: the final validation loss of DDP (float32) with the same seed. Time is training time "
        "(evaluation, logging and checkpoints excluded). vs DDP = steps ratio x time-per-step ratio: "
        "the first factor is the optimizer's (how many of DDP's steps it needs for that loss), the "
        "second the network's and the method's own work. BLEU in DDP's time: of the last checkpoint "
        "saved within DDP's training time of the same seed. Inter-node bytes: the tbf counters over the "
        "whole launch (evaluations and checkpoints included), per rank and step. Each cell: the mean "
        "over seeds, then each seed's value.",
        "",
        "| method | time to target s | vs DDP | steps ratio | time-per-step ratio | ms/step "
        "| final valid NLL | BLEU | BLEU in DDP's time | inter-node MB/rank/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in report["methods"].items():
        sent = m["inter_node_bytes_per_step"]
        megabytes = {
            "mean": None if sent["mean"] is None else sent["mean"] / 1e6,
            "by_seed": [None if v is None else v / 1e6 for v in sent["by_seed"]],
        }
        rate = report.get("chosen_lr", {}).get(name)
        failed = ", ".join(map(str, m.get("failed_seeds", [])))
        lines.append(
            f"| {label(name)}{'' if rate is None else f' (lr {rate:g})'}"
            f"{f' (FAILED: seed {failed})' if failed else ''} "
            f"| {_mean_and_seeds(m['time_to_target_s'], '.0f', 'not reached')} "
            f"| {_mean_and_seeds(m['time_ratio'], '.2f')} | {_mean_and_seeds(m['steps_ratio'], '.2f')} "
            f"| {_mean_and_seeds(m['per_step_ratio'], '.2f')} | {_mean_and_seeds(m['ms_per_iter'], '.0f')} "
            f"| {_mean_and_seeds(m['final_valid_nll'], '.3f')} | {_mean_and_seeds(m['bleu'], '.2f')} "
            f"| {_mean_and_seeds(m['bleu_in_allreduce_time'], '.2f')} | {_mean_and_seeds(megabytes, '.1f')} |"
        )
    signatures = sorted({r["bleu_signature"] for r in report["runs"].values() if r.get("bleu_signature")})
    return [*lines, "", *[f"Signature: `BLEU|{s}`." for s in signatures], ""]


def failed_section(report: dict[str, Any]) -> list[str]:
    """The trainings that failed: where they stopped and the first lines of why (the JSON has more)."""
    trained = report.get("grid") or report["runs"]
    failed = {key: run for key, run in trained.items() if "failed" in run}
    if not failed:
        return []
    lines = [
        "## Failed trainings",
        "",
        "Their numbers above are up to their last evaluation; they are not scored and are no target. "
        "The whole message and the failed rank's log tail: `failed` in the JSON.",
        "",
    ]
    for key, run in failed.items():
        last = run["curve"][-1]["step"] if run["curve"] else None
        first = run["failed"].strip().splitlines()[0] if run["failed"].strip() else "(no message)"
        lines.append(f"- `{key}`: last evaluation at step {fmt(last)} of {run['steps']}; {first}")
    return [*lines, ""]


def goals_section(report: dict[str, Any]) -> list[str]:
    """The default's goals and, where it is not sooner than a method, why."""
    if not report.get("goals"):
        return []
    lines = ["## Goals (the library's default)", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['measured']} | {'yes' if g['met'] else 'no'} |" for g in report["goals"]]
    return [*lines, "", *(f"- {note.text}" for note in slower_notes(report["methods"])), ""]


def order_table(report: dict[str, Any]) -> list[str]:
    """The trainings in the order they ran, with the machine's load during each."""
    trained = report.get("grid") or report["runs"]
    rows = sorted(trained.items(), key=lambda item: item[1]["order"])
    lines = [
        "## The trainings in the order they ran, and the machine's load",
        "",
        "Load: the 1-minute load average sampled every 5 s during the launch (mean / max; the 4 ranks "
        "alone make about 4) and the share of CPU time busy (/proc/stat).",
        "",
        "| # | run | wall s | training s | load mean / max | CPU busy |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for key, run in rows:
        load = run.get("load", {})
        lines.append(
            f"| {run['order']} | `{key}`{' (failed)' if 'failed' in run else ''} "
            f"| {fmt(run.get('wall_seconds'))} "
            f"| {fmt(run['curve'][-1]['train_seconds'] if run['curve'] else None)} "
            f"| {fmt(load.get('loadavg_1min_mean'), '.2f')} / {fmt(load.get('loadavg_1min_max'), '.2f')} "
            f"| {fmt(load.get('cpu_busy_share'), '.0%')} |"
        )
    return [*lines, ""]


def curve_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Every run's validation loss (and training seconds) at each evaluated step."""
    names = list(runs)
    steps = sorted({int(p["step"]) for run in runs.values() for p in run["curve"]})
    header = "| step | " + " | ".join(f"{label(runs[n]['method'])} (s)" for n in names) + " |"
    lines = [header, "|---:|" + "---:|" * len(names)]
    for step in steps:
        cells = []
        for name in names:
            point = next((p for p in runs[name]["curve"] if int(p["step"]) == step), None)
            cells.append("-" if point is None else f"{point['valid_nll']:.3f} ({point['train_seconds']:.0f})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def summary(report: dict[str, Any]) -> str:
    """One line per method for the terminal (after :func:`analyse`)."""
    lines = []
    for name, m in report["methods"].items():
        lines.append(
            f"{name:20s} time to target {_mean_and_seeds(m['time_to_target_s'], '.0f', 'not reached')} s, "
            f"vs DDP {_mean_and_seeds(m['time_ratio'], '.2f')}, valid nll "
            f"{_mean_and_seeds(m['final_valid_nll'], '.3f')}, BLEU {_mean_and_seeds(m['bleu'], '.2f')}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Validation loss against training time and against steps, every run."""
    curves = {key: run["curve"] for key, run in report["runs"].items()}
    targets = [
        r["target_valid_nll"]
        for r in report["runs"].values()
        if r["method"] == BASELINE and r["target_valid_nll"] is not None
    ]
    title = (
        f"{report['preset']}, {NODES} nodes x {RANKS_PER_NODE}, links {report['link']['rate_mbit']:g} Mbit/s"
    )
    plot_curves(curves, title, path, min(targets) if targets else None)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Analyse ``report`` and write ``time_to_quality.{md,json,png}`` into ``out_dir``."""
    analyse(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{STEM}.md", out_dir / f"{STEM}.json", out_dir / f"{STEM}.png"]
    paths[0].write_text(markdown(report))
    paths[1].write_text(json.dumps(report, indent=2) + "\n")
    plot(report, paths[2])
    return paths
