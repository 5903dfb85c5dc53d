"""The benchmark's report: ``time_to_quality.{md,json,png}`` from a run's measurements (analysed by
``curves``, explained by ``notes``), and the terminal summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.time_to_quality.curves import analyse
from benchmarks.time_to_quality.methods import BASELINE, NODES, RANKS_PER_NODE, label
from benchmarks.time_to_quality.notes import Note, baseline_note, dominant_term, miss_notes, model_notes
from benchmarks.time_to_quality.rates import allreduce_comm_s
from recipes.translation.compare import plot_curves

STEM = "time_to_quality"


def fmt(value: float | None, spec: str = ".0f", missing: str = "-") -> str:
    """``value`` formatted, or ``missing`` when there is none."""
    return missing if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    """The report's text (after :func:`~benchmarks.time_to_quality.curves.analyse`)."""
    runs: dict[str, dict[str, Any]] = report["runs"]
    cal = report["calibration"]
    link = report["link"]
    compute_ms = cal["compute_s"] * 1e3
    probed_comm = allreduce_comm_s(
        report["model_inputs"]["inter_bytes_per_s"] * 8 / 1e6, cal["param_bytes"]
    )  # tbf passes TCP payload at a little under its rate (headers, the other direction's ACKs)
    lines = [
        "# Time to the same translation quality on a slow network: All-Reduce against decentralized Adam",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"Preset `{report['preset']}` with "
        + (f"`{' '.join(report['overrides'])}`, " if report["overrides"] else "no overrides, ")
        + f"{report['steps']} steps per method, validation loss every {report['eval_every']} steps, "
        f"{NODES} emulated nodes x {RANKS_PER_NODE} ranks (benchmarks/cluster/netns.py), "
        f"same seed (initial weights and data order) for every method. "
        f"Machine: {report['machine'].get('cpu', '?')}, {report['machine'].get('cores', '?')} cores, "
        f"torch {report['machine'].get('torch', '?')}, {report['machine'].get('date', '?')}.",
        "",
        *_paragraphs(baseline_note(report)),
        "## Inputs, measured before the runs",
        "",
        "| input | value |",
        "|---|---|",
        f"| C: forward + backward per iteration, 4 ranks at once (slowest rank per step; mean rank) "
        f"| {compute_ms:.0f} ms; {cal['compute_mean_s'] * 1e3:.0f} ms |",
        f"| f: forward share of C | {cal['forward_fraction']:.2f} |",
        f"| S: parameter bytes | {cal['param_bytes'] / 1e6:.1f} MB ({cal['params'] / 1e6:.2f}M float32) |",
        f"| U_ar: AdamW step; U_dec: DecentralizedAdam step (no network) "
        f"| {cal['adamw_s'] * 1e3:.0f} ms; {cal['decentralized_s'] * 1e3:.0f} ms |",
        f"| node link rate (tbf, per direction) | {link['rate_mbit']:g} Mbit/s ({link['how']}) |",
        f"| All-Reduce communication per iteration at that rate (model) "
        f"| {link['allreduce_comm_s'] * 1e3:.0f} ms = "
        f"{link['allreduce_comm_s'] / cal['compute_s']:.2f} x C |",
        f"| B_inter: TCP, one stream each way over a node link | "
        f"{report['model_inputs']['inter_bytes_per_s'] / 1e6:.1f} MB/s |",
        f"| All-Reduce communication per iteration with the probed B_inter (model) "
        f"| {probed_comm * 1e3:.0f} ms = {probed_comm / cal['compute_s']:.2f} x C |",
        f"| B_intra: TCP on a node's loopback, all ranks at once | "
        f"{report['model_inputs']['intra_bytes_per_s'] / 1e6:.0f} MB/s |",
        "",
        "## Results",
        "",
    ]
    target = report.get("target_valid_nll")
    never = "-" if target is None else "not reached"  # no target without an All-Reduce run
    lines += [
        f"Target: All-Reduce's final validation loss, {fmt(target, '.3f')} (NLL per target token). "
        "Time is training time (evaluation, logging and checkpoints excluded); wall time is the whole "
        "launch (start-up, evaluations, checkpoints).",
        "",
        "| method | wall s | training s | ms/iter | predicted ms/iter (overlapped / serialized) "
        "| vs All-Reduce (measured / predicted) | model: bound by | time to target s | vs All-Reduce "
        "| final valid NLL | BLEU | chrF | inter-node MB/rank/iter (tc / model) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in runs.items():
        predicted = run.get("predicted") or {}
        reached = run.get("time_to_target_s")
        lines.append(
            f"| {label(name)} | {fmt(run.get('wall_seconds'))} "
            f"| {fmt(run.get('train_seconds'))} | {fmt(run.get('ms_per_iter'))} "
            f"| {fmt(predicted.get('iteration_ms'))} / {fmt(predicted.get('serial_ms'))} "
            f"| {fmt(run.get('iter_ratio'), '.2f')} / {fmt(run.get('predicted_iter_ratio'), '.2f')} "
            f"| {dominant_term(run, compute_ms)} "
            f"| {fmt(reached, '.0f', never)} | {fmt(run.get('time_ratio'), '.2f')} "
            f"| {fmt(run.get('final_valid_nll'), '.3f')} | {fmt(run.get('bleu'), '.2f')} "
            f"| {fmt(run.get('chrf'), '.2f')} "
            f"| {fmt(run.get('link_mb_per_rank_iter'), '.1f')} / {fmt(predicted.get('inter_mb'), '.1f')} |"
        )
    signatures = sorted({run["bleu_signature"] for run in runs.values() if run.get("bleu_signature")})
    lines += [""] + [f"Signature: `BLEU|{s}`." for s in signatures]
    lines += [
        "",
        "ms/iter: training seconds per step between the first and the last evaluation. Predicted: "
        "`decentadam.runtime_model` from C, f, S, U and the probed links only; *overlapped* as for a "
        "real cluster, *serialized* with updates and exchanges taking turns on the shared cores. "
        "Inter-node bytes are the tbf counters over the whole launch (evaluations and checkpoints "
        "included), per rank and step.",
        "",
    ]
    if report.get("goals"):
        lines += ["## Goals", "", "| goal | measured | met |", "|---|---|---|"]
        lines += [
            f"| {g['goal']} | {g['measured']} | {'yes' if g['met'] else 'no'} |" for g in report["goals"]
        ]
        notes = [*model_notes(runs, compute_ms), *miss_notes(report, compute_ms)]
        lines += ["", *(f"- {note.text}" for note in notes), ""]
    if report.get("levels"):
        lines += levels_table(report)
    lines += ["## Validation loss at each evaluation", ""]
    lines += curve_table(runs)
    lines += ["", "Plot: `time_to_quality.png`; every number above: `time_to_quality.json`.", ""]
    return "\n".join(lines)


def levels_table(report: dict[str, Any]) -> list[str]:
    """Time (and steps) each method takes to reach each of All-Reduce's evaluated losses."""
    names = [n for n in report["runs"] if n != BASELINE]
    if not names:  # All-Reduce alone (a run to be the --baseline of others): nothing to compare
        return []
    lines = [
        "## Time to each of All-Reduce's validation losses",
        "",
        "Each row is one of All-Reduce's evaluations; a method's time to that loss is interpolated "
        "between its own evaluations. vs All-Reduce = steps ratio x time-per-step ratio: the first "
        "factor is the optimizer's (how many more steps it needs for that loss), the second the "
        "network's.",
        "",
        "| All-Reduce step | valid NLL | All-Reduce s | "
        + " | ".join(f"{label(n)} s (steps) | vs All-Reduce" for n in names)
        + " |",
        "|---:|---:|---:|" + "---:|---:|" * len(names),
    ]
    for row in report["levels"]:
        cells = [f"{row['step']:.0f}", f"{row['valid_nll']:.3f}", f"{row['train_seconds']:.0f}"]
        for name in names:
            m = row["methods"][name]
            if m["seconds"] is None:
                cells += ["not reached", "-"]
                continue
            cells.append(f"{m['seconds']:.0f} ({m['steps']:.0f})")
            per_step = m["time_ratio"] / m["steps_ratio"] if m["steps_ratio"] else None
            cells.append(f"{m['time_ratio']:.2f} = {m['steps_ratio']:.2f} x {fmt(per_step, '.2f')}")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def summary(report: dict[str, Any]) -> str:
    """One line per method for the terminal (after :func:`analyse`)."""
    lines = []
    for name, run in report["runs"].items():
        reached = run.get("time_to_target_s")
        lines.append(
            f"{label(name):26s} {fmt(run.get('ms_per_iter'))} ms/iter "
            f"(predicted {fmt((run.get('predicted') or {}).get('iteration_ms'))}), time to target "
            f"{'not reached' if reached is None else f'{reached:.0f} s'}, "
            f"valid nll {fmt(run.get('final_valid_nll'), '.3f')}, BLEU {fmt(run.get('bleu'), '.2f')}"
        )
    return "\n".join(lines)


def curve_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Every method's validation loss (and training seconds) at each evaluated step."""
    names = list(runs)
    steps = sorted({int(p["step"]) for run in runs.values() for p in run["curve"]})
    header = "| step | " + " | ".join(f"{label(n)} (s)" for n in names) + " |"
    lines = [header, "|---:|" + "---:|" * len(names)]
    for step in steps:
        cells = []
        for name in names:
            point = next((p for p in runs[name]["curve"] if int(p["step"]) == step), None)
            cells.append("-" if point is None else f"{point['valid_nll']:.3f} ({point['train_seconds']:.0f})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    """Validation loss against training time and against steps, every method, the target marked."""
    curves = {}
    for name, run in report["runs"].items():
        legend = label(name) + ("" if run.get("bleu") is None else f": BLEU {run['bleu']:.2f}")
        curves[legend] = run["curve"]
    title = (
        f"{report['preset']}, {NODES} nodes x {RANKS_PER_NODE}, links {report['link']['rate_mbit']:g} Mbit/s"
    )
    plot_curves(curves, title, path, report.get("target_valid_nll"))


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Analyse ``report`` and write ``time_to_quality.{md,json,png}`` into ``out_dir``."""
    analyse(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{STEM}.md", out_dir / f"{STEM}.json", out_dir / f"{STEM}.png"]
    paths[0].write_text(markdown(report))
    paths[1].write_text(json.dumps(report, indent=2) + "\n")
    plot(report, paths[2])
    return paths


def _paragraphs(notes: list[Note]) -> list[str]:
    return [line for note in notes for line in (note.text, "")]
