"""Time to the same translation quality on a slow network: All-Reduce against decentralized AccumAdam.

As root, from the repository root (the lock keeps other CPU-heavy jobs off the cores)::

    flock /tmp/decentadam-cpu.lock .venv/bin/python benchmarks/time_to_quality.py \\
        --data ../shared/data/multi30k --steps 600 --eval-every 50 optim.accum_steps=2 optim.lr=2e-3

trains the translation recipe's preset (``multi30k-en-de``: 4 ranks as 2 nodes x 2) on the emulated
cluster of ``benchmarks/cluster/`` with All-Reduce (DDP + AdamW), AccumAdam on AER and AccumAdam on
the complete graph, and reports how long each takes to reach All-Reduce's final validation loss:

1. Calibration, no network: ``time_to_quality_calibrate.py`` on the 4 ranks at once times the
   forward + backward of an iteration (C, with its forward share f), the optimizer steps (U_ar of
   AdamW, U_dec of DecentralizedAdam) and counts the parameter bytes S.
2. The node links' rate: the one at which ``decentadam.runtime_model`` puts All-Reduce's
   communication per iteration on 2 nodes x 2 at ``--comm-ratio`` x C (1.5: the paper's
   communication-bound En-De setting); ``--link-mbit`` sets it instead.
3. The emulated cluster (``benchmarks/cluster/netns.py``: one namespace per node, tbf on every node
   link) at that rate; TCP probes measure the links for the runtime model (``run.probe``).
4. Each method: ``python -m recipes.translation.train`` once per rank, in its node's namespace, with the
   environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR =
   node 0's address) and ``GLOO_SOCKET_IFNAME=eth0``, as ``benchmarks/cluster/run.py`` starts its
   workers: a same-node peer is reached over ``lo``, another node's through the shaped link. One
   process per rank needs no launcher agent per node and no rendezvous beyond gloo's own store.
   Every method runs the same steps from the same seed (initial weights and data order).
5. After teardown, ``python -m eval.bleu`` scores each final checkpoint on the preset's test split
   (``recipes.translation.compare.bleu``).
6. ``benchmarks/results/time_to_quality.{md,json,png}``.

``--render benchmarks/results/time_to_quality.json`` writes the report again from a run's JSON.

Time is the recipe's training time (``train_seconds`` in ``metrics.jsonl``: evaluation, logging
and checkpoints excluded); ms per iteration is measured between the first and the last evaluation,
after the first ``eval_every`` steps. Extra ``key=value`` arguments go to every training.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.cluster.linkprobe import probe  # noqa: E402
from benchmarks.cluster.netns import ClusterSpec, EmulatedCluster, missing_requirements  # noqa: E402
from benchmarks.machine import machine  # noqa: E402
from decentadam.runtime_model import ALLREDUCE, Cluster, Prediction, Workload, predict  # noqa: E402
from recipes.translation.compare import bleu, curve, plot_curves  # noqa: E402

logger = logging.getLogger("time-to-quality")

RESULTS = REPO / "benchmarks" / "results"
TRAIN = "recipes.translation.train"
"""The recipe's module, started with ``python -m`` from the repository root."""
CALIBRATE = Path(__file__).resolve().parent / "time_to_quality_calibrate.py"
STEM = "time_to_quality"
NODES, RANKS_PER_NODE = 2, 2
BUCKET_BYTES = 25 * 2**20
"""DDP's bucket_cap_mb and DecentralizedAdam's bucket_size_mb, both 25 MB by default."""
TIME_GOAL = 0.7
"""AER should reach All-Reduce's final validation loss in at most this share of All-Reduce's time."""
BLEU_GOAL = 0.5
"""... and end within this many BLEU points of it."""
MODEL_TOLERANCE = 0.15
"""The runtime model's AER / All-Reduce iteration ratio should be within 15% of the measured one."""


@dataclass(frozen=True)
class Method:
    """One training configuration of the comparison."""

    name: str
    """Name on the command line (``--methods``) and in the JSON."""
    label: str
    """Name in the report."""
    model: str
    """The runtime model's name for it."""
    args: tuple[str, ...]
    """What ``train.py`` gets to run it."""


METHODS = {
    m.name: m
    for m in (
        Method("allreduce", "All-Reduce (DDP + AdamW)", ALLREDUCE, ("--optimizer", "allreduce")),
        Method("aer", "AccumAdam-AER", "aer", ("--optimizer", "decentralized", "optim.topology=aer")),
        Method(
            "complete",
            "AccumAdam-complete",
            "complete",
            ("--optimizer", "decentralized", "optim.topology=complete"),
        ),
    )
}
BASELINE = "allreduce"
CONTROLLED = (
    "data.path", "train.max_steps", "train.max_minutes", "train.output_dir", "train.eval_every",
    "optim.optimizer", "optim.topology", "optim.local_world_size",
)  # fmt: skip
"""Settings the benchmark sets itself (from its options); an override of one is an error."""


# ------------------------------------------------------------------------------------ the link rate


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


# ------------------------------------------------------------------------------------ analysis


def steady_ms_per_iter(points: Sequence[dict[str, float]]) -> float | None:
    """ms per iteration between the first and the last evaluation (the first interval is warm-up);
    with one evaluation, over the whole run."""
    if not points:
        return None
    first, last = points[0], points[-1]
    if len(points) == 1 or last["step"] == first["step"]:
        return 1e3 * last["train_seconds"] / last["step"]
    return 1e3 * (last["train_seconds"] - first["train_seconds"]) / (last["step"] - first["step"])


def comm_wait_ms(run: Path) -> float | None:
    """Mean time a rank blocked per step waiting for its exchanges (the recipe's
    ``decentadam/comm_wait_ms``, logged to TensorBoard every ``log_every`` steps as a mean over ranks),
    over a run's log windows; None for a run without it (All-Reduce)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: list[float] = []
    for events in sorted((run / "tb").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "decentadam/comm_wait_ms" in accumulator.Tags()["scalars"]:
            values += [event.value for event in accumulator.Scalars("decentadam/comm_wait_ms")]
    return statistics.fmean(values) if values else None


def time_to_reach(
    points: Sequence[dict[str, float]], target: float, key: str = "train_seconds"
) -> float | None:
    """Training seconds (or another ``key`` of the points, e.g. ``step``) at which the validation loss
    first reaches ``target``, linearly interpolated between evaluations; the first evaluation's value
    if it is already there; None if never."""
    previous: dict[str, float] | None = None
    for point in points:
        if point["valid_nll"] <= target:
            if previous is None:
                return point[key]
            fraction = (previous["valid_nll"] - target) / (previous["valid_nll"] - point["valid_nll"])
            return previous[key] + fraction * (point[key] - previous[key])
        previous = point
    return None


def levels(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Time and steps each method takes to reach each of All-Reduce's evaluated validation losses.

    A method's time ratio to All-Reduce at a level is its steps ratio (how many more optimizer steps
    it needs for that loss) times its time-per-step ratio (what the network costs it), which is how
    the report separates the optimizer's part from the network's. Empty without an All-Reduce run.
    """
    baseline = runs.get(BASELINE)
    if baseline is None:
        return []
    rows = []
    for point in baseline["curve"]:
        target = point["valid_nll"]
        row: dict[str, Any] = {
            "step": point["step"],
            "valid_nll": target,
            "train_seconds": point["train_seconds"],
            "methods": {},
        }
        for name, run in runs.items():
            seconds = time_to_reach(run["curve"], target)
            steps = time_to_reach(run["curve"], target, key="step")
            row["methods"][name] = {
                "seconds": seconds,
                "steps": steps,
                "time_ratio": _ratio(seconds, point["train_seconds"]),
                "steps_ratio": _ratio(steps, point["step"]),
            }
        rows.append(row)
    return rows


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """Add what the runs' curves and predictions imply: steady ms per iteration, time to All-Reduce's
    final validation loss, ratios to All-Reduce, and the goals. Returns ``report`` (changed in place)."""
    runs: dict[str, dict[str, Any]] = report["runs"]
    baseline = runs.get(BASELINE)
    target = baseline["curve"][-1]["valid_nll"] if baseline and baseline["curve"] else None
    report["target_valid_nll"] = target
    for run in runs.values():
        points = run["curve"]
        run["ms_per_iter"] = steady_ms_per_iter(points)
        run["train_seconds"] = points[-1]["train_seconds"] if points else None
        run["final_valid_nll"] = points[-1]["valid_nll"] if points else None
        run["time_to_target_s"] = time_to_reach(points, target) if target is not None else None
    if baseline is not None:
        for run in runs.values():
            run["time_ratio"] = _ratio(run["time_to_target_s"], baseline["time_to_target_s"])
            run["iter_ratio"] = _ratio(run["ms_per_iter"], baseline["ms_per_iter"])
            predicted = run.get("predicted")
            base_predicted = baseline.get("predicted")
            run["predicted_iter_ratio"] = (
                _ratio(predicted["iteration_ms"], base_predicted["iteration_ms"])
                if predicted and base_predicted
                else None
            )
    report["levels"] = levels(runs)
    report["goals"] = _goals(runs)
    return report


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _goals(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's checks of AER against All-Reduce (empty without both runs)."""
    aer, base = runs.get("aer"), runs.get(BASELINE)
    if aer is None or base is None:
        return []
    goals = []
    ratio = aer.get("time_ratio")
    goals.append(
        {
            "goal": f"AER reaches All-Reduce's final validation loss in <= {TIME_GOAL:g}x its time",
            "measured": "not reached" if ratio is None else f"{ratio:.2f}x",
            "met": ratio is not None and ratio <= TIME_GOAL,
        }
    )
    if aer.get("bleu") is not None and base.get("bleu") is not None:
        gap = base["bleu"] - aer["bleu"]
        goals.append(
            {
                "goal": f"AER's BLEU within {BLEU_GOAL:g} of All-Reduce's",
                "measured": f"{aer['bleu']:.2f} vs {base['bleu']:.2f} ({-gap:+.2f})",
                "met": gap <= BLEU_GOAL,
            }
        )
    measured, predicted = aer.get("iter_ratio"), aer.get("predicted_iter_ratio")
    if measured is not None and predicted is not None:
        error = predicted / measured - 1
        goals.append(
            {
                "goal": f"the runtime model's AER / All-Reduce iteration ratio within "
                f"{MODEL_TOLERANCE:.0%} of the measured one",
                "measured": f"predicted {predicted:.2f}, measured {measured:.2f} ({error:+.0%})",
                "met": abs(error) <= MODEL_TOLERANCE,
            }
        )
    return goals


def dominant_term(run: dict[str, Any], compute_ms: float) -> str:
    """Which term the runtime model says sets this method's iteration: compute or communication."""
    predicted = run.get("predicted")
    if not predicted:
        return "-"
    comm = predicted["comm_ms"]
    if comm > compute_ms:
        return f"communication ({comm:.0f} ms > C)"
    return f"compute (C; communication {comm:.0f} ms)"


# ------------------------------------------------------------------------------------ report


def _fmt(value: float | None, spec: str = ".0f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    runs: dict[str, dict[str, Any]] = report["runs"]
    cal = report["calibration"]
    link = report["link"]
    compute_ms = cal["compute_s"] * 1e3
    probed_comm = allreduce_comm_s(
        report["model_inputs"]["inter_bytes_per_s"] * 8 / 1e6, cal["param_bytes"]
    )  # tbf passes TCP payload at a little under its rate (headers, the other direction's ACKs)
    lines = [
        "# Time to the same translation quality on a slow network: All-Reduce against AccumAdam",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"Preset `{report['preset']}` with `{' '.join(report['overrides']) or 'no overrides'}`, "
        f"{report['steps']} steps per method, validation loss every {report['eval_every']} steps, "
        f"{NODES} emulated nodes x {RANKS_PER_NODE} ranks (benchmarks/cluster/netns.py), "
        f"same seed (initial weights and data order) for every method. "
        f"Machine: {report['machine'].get('cpu', '?')}, {report['machine'].get('cores', '?')} cores, "
        f"torch {report['machine'].get('torch', '?')}, {report['machine'].get('date', '?')}.",
        "",
        *_baseline_note(report),
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
        f"Target: All-Reduce's final validation loss, {_fmt(target, '.3f')} (NLL per target token). "
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
            f"| {METHODS[name].label if name in METHODS else name} | {_fmt(run.get('wall_seconds'))} "
            f"| {_fmt(run.get('train_seconds'))} | {_fmt(run.get('ms_per_iter'))} "
            f"| {_fmt(predicted.get('iteration_ms'))} / {_fmt(predicted.get('serial_ms'))} "
            f"| {_fmt(run.get('iter_ratio'), '.2f')} / {_fmt(run.get('predicted_iter_ratio'), '.2f')} "
            f"| {dominant_term(run, compute_ms)} "
            f"| {_fmt(reached, '.0f', never)} | {_fmt(run.get('time_ratio'), '.2f')} "
            f"| {_fmt(run.get('final_valid_nll'), '.3f')} | {_fmt(run.get('bleu'), '.2f')} "
            f"| {_fmt(run.get('chrf'), '.2f')} "
            f"| {_fmt(run.get('link_mb_per_rank_iter'), '.1f')} / {_fmt(predicted.get('inter_mb'), '.1f')} |"
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
        lines += ["", *_model_notes(runs, compute_ms), *_miss_notes(report, compute_ms), ""]
    if report.get("levels"):
        lines += _levels_table(report)
    lines += ["## Validation loss at each evaluation", ""]
    lines += _curve_table(runs)
    lines += ["", "Plot: `time_to_quality.png`; every number above: `time_to_quality.json`.", ""]
    return "\n".join(lines)


def _model_notes(runs: dict[str, dict[str, Any]], compute_ms: float) -> list[str]:
    """Per method, what the runtime model says sets its iteration, next to the measurement."""
    notes = []
    for name, run in runs.items():
        predicted = run.get("predicted")
        if not predicted or run.get("ms_per_iter") is None:
            continue
        error = predicted["iteration_ms"] / run["ms_per_iter"] - 1
        notes.append(
            f"- {METHODS[name].label if name in METHODS else name}: measured {run['ms_per_iter']:.0f} ms "
            f"per iteration; the model predicts {predicted['iteration_ms']:.0f} ms ({error:+.0%}), "
            f"bound by {dominant_term(run, compute_ms)} with C = {compute_ms:.0f} ms; with free "
            f"optimizer steps {predicted['lower_bound_ms']:.0f} ms, with updates and exchanges taking "
            f"turns {predicted['serial_ms']:.0f} ms." + _wait_note(run, predicted, compute_ms)
        )
    return notes


def _baseline_note(report: dict[str, Any]) -> list[str]:
    """Where All-Reduce's run came from when it was not trained in this run (``--baseline``)."""
    base = report["runs"].get(BASELINE) or {}
    if not base.get("from"):
        return []
    return [
        f"All-Reduce was not trained in this run: its run ({base['steps']} steps, same preset, overrides "
        f"and link rate) is the one in `{base['from']}`, made by `{base['command']}`; its time is "
        "compared with this run's.",
        "",
    ]


def _wait_note(run: dict[str, Any], predicted: dict[str, Any], compute_ms: float) -> str:
    """What the ranks' measured waiting for exchanges says about the model's overlap."""
    wait = run.get("comm_wait_ms")
    if wait is None:
        return ""
    note = f" Its ranks blocked {wait:.0f} ms per step waiting for exchanges (decentadam/comm_wait_ms)"
    missed = predicted["iteration_ms"] < 0.9 * run["ms_per_iter"]  # the model >10% fast
    if missed and predicted["comm_ms"] <= compute_ms and wait > 0.1 * compute_ms:
        return note + (
            ", where the model has the exchange hidden under the next step's compute: the overlap is "
            "the term it misses (this run does not tell whether the exchange's own CPU work on the "
            "shared cores or a partner's slower step is what the ranks wait for)."
        )
    return note + "."


def _miss_notes(report: dict[str, Any], compute_ms: float) -> list[str]:
    """When AER does not reach the target: how far it got, and the two factors of its time ratio at
    the last of All-Reduce's losses it did reach (steps, which the optimizer sets; time per step,
    which the network sets)."""
    runs = report["runs"]
    aer, base = runs.get("aer"), runs.get(BASELINE)
    if aer is None or base is None or aer.get("time_to_target_s") is not None or not aer["curve"]:
        return []
    notes = [
        f"- AccumAdam-AER did not reach All-Reduce's final validation loss "
        f"({report['target_valid_nll']:.3f}) in {aer.get('steps', report['steps'])} steps: it ended at "
        f"{aer['final_valid_nll']:.3f}. Its iteration took {_fmt(aer.get('iter_ratio'), '.2f')} x "
        f"All-Reduce's (the model: All-Reduce bound by {dominant_term(base, compute_ms)}, AER by "
        f"{dominant_term(aer, compute_ms)})"
        + (
            "; what it lacks is progress per optimizer step, not network time."
            if (aer.get("iter_ratio") or math.inf) < 1
            else "; it was not faster per iteration either."
        )
    ]
    notes += _topology_note(runs)
    reached = [row for row in report.get("levels", []) if row["methods"]["aer"]["seconds"] is not None]
    if reached:
        last = reached[-1]
        m = last["methods"]["aer"]
        notes.append(
            f"- The last of All-Reduce's evaluated losses AER reached: {last['valid_nll']:.3f} (its step "
            f"{last['step']:.0f}), after {m['steps']:.0f} steps = {m['steps_ratio']:.2f} x as many, "
            f"in {m['time_ratio']:.2f} x the time = {m['steps_ratio']:.2f} (steps) x "
            f"{m['time_ratio'] / m['steps_ratio']:.2f} (time per step)."
        )
    return notes


def _topology_note(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Whether AER's distance to All-Reduce is the gossip's: compare it with AccumAdam on the complete
    graph (every rank gets the exact average every step) at equal steps."""
    if "complete" not in runs:
        return []
    by_step = {name: {p["step"]: p["valid_nll"] for p in runs[name]["curve"]} for name in ("aer", "complete")}
    base = {p["step"]: p["valid_nll"] for p in runs[BASELINE]["curve"]}
    steps = sorted(set(by_step["aer"]) & set(by_step["complete"]) & set(base))
    if not steps:
        return []
    between = max(abs(by_step["aer"][t] - by_step["complete"][t]) for t in steps)
    behind = [min(by_step["aer"][t], by_step["complete"][t]) - base[t] for t in steps]
    return [
        f"- AccumAdam-complete (the exact average of all replicas every step) and AER differ by at most "
        f"{between:.3f} in validation loss at equal steps, while All-Reduce is {min(behind):.2f} to "
        f"{max(behind):.2f} below the better of the two: the distance is not the gossip's (partial "
        "mixing) but in what both AccumAdam runs do and All-Reduce does not, the Adam step on each "
        "rank's own gradient before the average (they also differ in beta2 and the accumulation "
        "window, which the translation recipe's 400-step probes found not to move the curve)."
    ]


def _levels_table(report: dict[str, Any]) -> list[str]:
    """Time (and steps) each method takes to reach each of All-Reduce's evaluated losses."""
    names = [n for n in report["runs"] if n != BASELINE]
    label = {n: METHODS[n].label if n in METHODS else n for n in names}
    lines = [
        "## Time to each of All-Reduce's validation losses",
        "",
        "Each row is one of All-Reduce's evaluations; a method's time to that loss is interpolated "
        "between its own evaluations. vs All-Reduce = steps ratio x time-per-step ratio: the first "
        "factor is the optimizer's (how many more steps it needs for that loss), the second the "
        "network's.",
        "",
        "| All-Reduce step | valid NLL | All-Reduce s | "
        + " | ".join(f"{label[n]} s (steps) | vs All-Reduce" for n in names)
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
            cells.append(f"{m['time_ratio']:.2f} = {m['steps_ratio']:.2f} x {_fmt(per_step, '.2f')}")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def summary(report: dict[str, Any]) -> str:
    """One line per method for the terminal (after :func:`analyse`)."""
    lines = []
    for name, run in report["runs"].items():
        reached = run.get("time_to_target_s")
        lines.append(
            f"{METHODS[name].label if name in METHODS else name:26s} {_fmt(run.get('ms_per_iter'))} ms/iter "
            f"(predicted {_fmt((run.get('predicted') or {}).get('iteration_ms'))}), time to target "
            f"{'not reached' if reached is None else f'{reached:.0f} s'}, "
            f"valid nll {_fmt(run.get('final_valid_nll'), '.3f')}, BLEU {_fmt(run.get('bleu'), '.2f')}"
        )
    return "\n".join(lines)


def _curve_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    names = list(runs)
    steps = sorted({int(p["step"]) for run in runs.values() for p in run["curve"]})
    header = "| step | " + " | ".join(f"{METHODS[n].label if n in METHODS else n} (s)" for n in names) + " |"
    lines = [header, "|---:|" + "---:|" * len(names)]
    for step in steps:
        cells = []
        for name in names:
            point = next((p for p in runs[name]["curve"] if int(p["step"]) == step), None)
            cells.append("-" if point is None else f"{point['valid_nll']:.3f} ({point['train_seconds']:.0f})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    curves = {}
    for name, run in report["runs"].items():
        label = METHODS[name].label if name in METHODS else name
        if run.get("bleu") is not None:
            label += f": BLEU {run['bleu']:.2f}"
        curves[label] = run["curve"]
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


# ------------------------------------------------------------------------------------ processes


def _wait_all(
    procs: list[tuple[subprocess.Popen[bytes], Path]], timeout_s: float, what: str, echo: Path | None = None
) -> None:
    """Wait for every process; on a failure or the deadline, raise with the failed one's log tail.
    ``echo``: a log whose progress lines (evaluations, errors) are logged as they appear."""
    deadline = time.monotonic() + timeout_s
    shown = 0
    try:
        while True:
            if echo is not None:
                shown = _echo(echo, shown, what)
            if all(proc.poll() is not None for proc, _ in procs):
                break
            failed = [(proc, log) for proc, log in procs if proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                proc, log = failed[0] if failed else procs[0]
                why = f"exited with {proc.returncode}" if failed else f"timed out after {timeout_s:g} s"
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{what}: a rank {why}; its log ({log}):\n{tail}")
            time.sleep(0.5)
        bad = [(proc, log) for proc, log in procs if proc.returncode != 0]
        if bad:
            tail = bad[0][1].read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{what}: a rank exited with {bad[0][0].returncode}:\n{tail}")
    finally:
        for proc, _ in procs:  # only the processes started here, each by its own session id
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def _echo(log: Path, shown: int, what: str) -> int:
    """Log the new complete lines of rank 0's log that report progress; return how far it has read."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return shown
    end = text.rfind("\n") + 1
    for line in text[shown:end].splitlines():
        line = line.rsplit("\r", 1)[-1].strip()
        if line.startswith(("step ", "done", "error")) or "training pairs" in line:
            logger.info("[%s] %s", what, line)
    return max(shown, end)


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
        **extra,
    }


def calibrate(settings: Settings, logs: Path) -> dict[str, Any]:
    """Run the calibration on every rank at once; return the inputs the model and the rate need."""
    world = NODES * RANKS_PER_NODE
    base = {
        "preset": settings.preset,
        "overrides": settings.recipe_overrides(),
        "world_size": world,
        "local_world_size": RANKS_PER_NODE,
        "warmup": settings.calibration_warmup,
        "steps": settings.calibration_steps,
    }
    procs = []
    for rank in range(world):
        spec = {**base, "rank": rank, "out": str(logs / f"calibrate{rank}.json")}
        log = logs / f"calibrate{rank}.log"
        with open(log, "wb") as sink:
            argv = [sys.executable, str(CALIBRATE), json.dumps(spec)]
            proc = subprocess.Popen(
                argv, env=_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
            )
        procs.append((proc, log))
    _wait_all(procs, settings.timeout_s, "calibration")
    ranks = [json.loads((logs / f"calibrate{rank}.json").read_text()) for rank in range(world)]
    return summarize_calibration(ranks)


def summarize_calibration(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """C is the mean over steps of the slowest rank's forward + backward (the ranks wait for each
    other every step or two); the update times are means over ranks and steps."""
    per_step = [
        [f + b for f, b in zip(r["per_step"]["forward_s"], r["per_step"]["backward_s"], strict=True)]
        for r in ranks
    ]
    slowest = [max(values) for values in zip(*per_step, strict=True)]
    mean_compute = statistics.mean(r["compute_s"] for r in ranks)
    sizes = {r["param_bytes"] for r in ranks}
    if len(sizes) != 1:
        raise RuntimeError(f"the ranks built models of different sizes: {sorted(sizes)} bytes")
    return {
        "compute_s": statistics.mean(slowest),
        "compute_mean_s": mean_compute,
        "forward_fraction": statistics.mean(r["forward_s"] for r in ranks) / mean_compute,
        "adamw_s": statistics.mean(r["adamw_s"] for r in ranks),
        "decentralized_s": statistics.mean(r["decentralized_s"] for r in ranks),
        "param_bytes": ranks[0]["param_bytes"],
        "params": ranks[0]["params"],
        "test": ranks[0]["test"],
        "ranks": ranks,
    }


def train(
    cluster: EmulatedCluster, method: Method, settings: Settings, run: Path, port: int, logs: Path
) -> dict[str, Any]:
    """Train ``method`` with one process per rank in its node's namespace; return its command, wall
    seconds and the bytes that crossed the node links."""
    argv = [
        sys.executable, "-u", "-m", TRAIN, "--preset", settings.preset, *method.args,
        *settings.recipe_overrides(), *settings.run_settings(), f"train.output_dir={run}",
    ]  # fmt: skip
    world = NODES * RANKS_PER_NODE
    before = cluster.link_bytes()
    begin = time.monotonic()
    procs = []
    for rank in range(world):
        node, local = divmod(rank, RANKS_PER_NODE)
        env = _env(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
            MASTER_ADDR=cluster.spec.address(0),
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="eth0",  # bind to this node's address; same-node peers go over lo
        )
        log = logs / f"{method.name}.rank{rank}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(
                [*cluster.exec_prefix(node), *argv],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO,
            )
        procs.append((proc, log))
    _wait_all(procs, settings.timeout_s, method.name, echo=logs / f"{method.name}.rank0.log")
    wall = time.monotonic() - begin
    after = cluster.link_bytes()
    sent = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))  # node -> switch, every node
    return {
        "label": method.label,
        "steps": settings.steps,
        "train_command": shlex.join(argv),
        "wall_seconds": round(wall, 1),
        "link_mb_per_rank_iter": sent / (world * settings.steps) / 1e6,
    }


def predictions(method: Method, calibration: dict[str, Any], model_cluster: Cluster) -> dict[str, float]:
    """The runtime model's iteration times (ms) for one method, from the measured inputs only."""
    work = Workload(
        param_bytes=calibration["param_bytes"],
        compute_s=calibration["compute_s"],
        forward_fraction=calibration["forward_fraction"],
        update_s=calibration["decentralized_s"],
        allreduce_update_s=calibration["adamw_s"],
        bucket_bytes=BUCKET_BYTES,
        hierarchical=True,  # DecentralizedAdam on gloo sums multi-node groups in three phases
    )
    overlapped: Prediction = predict(method.model, model_cluster, work)
    serial = predict(method.model, model_cluster, replace(work, update_overlaps_comm=False))
    return {
        "iteration_ms": overlapped.iteration_s * 1e3,
        "serial_ms": serial.iteration_s * 1e3,
        "lower_bound_ms": overlapped.lower_bound_s * 1e3,
        "comm_ms": overlapped.comm_s * 1e3,
        "inter_mb": overlapped.inter_bytes_per_rank / 1e6,
    }


# ------------------------------------------------------------------------------------ main


@dataclass(frozen=True)
class Settings:
    """What one benchmark run does (from the command line)."""

    data: str
    steps: int
    eval_every: int
    methods: tuple[str, ...]
    preset: str = "multi30k-en-de"
    overrides: tuple[str, ...] = ()
    link_mbit: float | None = None
    link_how: str = "--link-mbit"
    """Where ``link_mbit`` came from, for the report."""
    comm_ratio: float = 1.5
    calibration_warmup: int = 3
    calibration_steps: int = 12
    work_dir: Path = Path("runs")
    out_dir: Path = RESULTS
    prefix: str = "dcq"
    bleu_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0
    baseline: dict[str, Any] | None = None
    """All-Reduce's run from an earlier report (``--baseline``; its path in ``from``), not trained again."""

    def recipe_overrides(self) -> list[str]:
        """Overrides for every process that reads the recipe's config: the data, then the user's."""
        return [f"data={self.data}", f"train.log_every={self.eval_every}", *self.overrides]

    def run_settings(self) -> list[str]:
        """Overrides that make the trainings comparable: equal steps, no time limit, 2 x 2 ranks."""
        return [
            f"train.max_steps={self.steps}",
            "train.max_minutes=0",
            f"train.eval_every={self.eval_every}",
            f"train.save_every={self.steps}",
            "train.keep_last=1",
            f"optim.local_world_size={RANKS_PER_NODE}",
        ]


def _controlled(key: str) -> bool:
    """Whether ``key`` (``section.key``, ``key`` or ``data``) names a setting the benchmark sets."""
    key = key.strip()
    return key in ("data", "path") or any(key in (name, name.split(".")[1]) for name in CONTROLLED)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", required=True, help="the preset's data directory, e.g. ../shared/data/multi30k"
    )
    parser.add_argument(
        "--steps", type=int, default=450, help="optimizer steps of every method (default 450)"
    )
    parser.add_argument(
        "--eval-every", type=int, help="steps between validation losses (default: steps / 10)"
    )
    parser.add_argument(
        "--methods",
        help=f"comma-separated, of {', '.join(METHODS)} (default: all, or all but allreduce with "
        "--baseline; the report compares to allreduce)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an earlier run's time_to_quality.json: compare to its All-Reduce run instead of training "
        "one (same preset and overrides; its link rate unless --link-mbit), e.g. to train AER for "
        "as long as All-Reduce took",
    )
    parser.add_argument("--preset", default="multi30k-en-de", help="translation preset (2 x 2 ranks)")
    parser.add_argument("--link-mbit", type=float, help="node link rate instead of the solved one")
    parser.add_argument(
        "--comm-ratio",
        type=float,
        default=1.5,
        help="solve the rate for All-Reduce communication = this x C per iteration (default 1.5)",
    )
    parser.add_argument("--calibration-steps", type=int, default=12, help="timed steps (default 12)")
    parser.add_argument("--calibration-warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="run directories (default: runs/time-to-quality-<UTC time>; new or empty)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="report directory")
    parser.add_argument("--prefix", default="dcq", help="network namespace name prefix")
    parser.add_argument("--bleu-arg", action="append", default=[], help="passed to eval.bleu (repeatable)")
    parser.add_argument("--timeout-min", type=float, help="per training (default: 10 min + 20 s per step)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every method")
    parser.epilog = (
        "time_to_quality.py --render JSON [--out-dir DIR] writes a run's report again from its JSON."
    )
    args = parser.parse_args(argv)

    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 10)
    if eval_every < 1:
        parser.error(f"--eval-every must be at least 1, got {eval_every}")
    if args.methods is None:
        args.methods = ",".join(m for m in METHODS if args.baseline is None or m != BASELINE)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    link_how, baseline = "--link-mbit", None
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        parser.error(f"--methods {args.methods!r}: expected distinct names of {', '.join(METHODS)}")
    if args.baseline is not None:
        if BASELINE in methods:
            parser.error(f"--baseline gives the {BASELINE} run: leave {BASELINE} out of --methods")
        baseline, baseline_rate = load_baseline(
            args.baseline, args.preset, tuple(args.overrides), parser.error
        )
        if args.link_mbit is None:
            args.link_mbit, link_how = baseline_rate, f"the rate of --baseline {args.baseline}"
    if args.link_mbit is not None and not args.link_mbit > 0:
        parser.error(f"--link-mbit must be > 0, got {args.link_mbit}")
    if not args.comm_ratio > 0:
        parser.error(f"--comm-ratio must be > 0, got {args.comm_ratio}")
    if args.calibration_steps < 1 or args.calibration_warmup < 0:
        parser.error("--calibration-steps must be >= 1 and --calibration-warmup >= 0")
    for item in args.overrides:
        if "=" not in item:
            parser.error(f"override {item!r} is not KEY=VALUE (e.g. optim.accum_steps=2)")
        if _controlled(item.split("=", 1)[0]):
            parser.error(
                f"override {item!r}: the benchmark sets that itself "
                "(use --data, --steps, --eval-every, --methods)"
            )
    data = Path(args.data)
    if not data.is_dir():
        parser.error(f"--data {args.data}: not a directory")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    work_dir = args.work_dir if args.work_dir is not None else Path("runs") / f"time-to-quality-{stamp}"
    if work_dir.exists() and any(work_dir.iterdir()):
        parser.error(f"--work-dir {work_dir} is not empty")
    timeout_min = args.timeout_min if args.timeout_min is not None else 10 + args.steps / 3
    return Settings(
        data=str(data.resolve()),
        steps=args.steps,
        eval_every=eval_every,
        methods=methods,
        preset=args.preset,
        overrides=tuple(args.overrides),
        link_mbit=args.link_mbit,
        link_how=link_how,
        comm_ratio=args.comm_ratio,
        calibration_warmup=args.calibration_warmup,
        calibration_steps=args.calibration_steps,
        work_dir=work_dir.resolve(),
        out_dir=args.out_dir,
        prefix=args.prefix,
        bleu_args=tuple(args.bleu_arg),
        timeout_s=timeout_min * 60,
        baseline=baseline,
    )


def load_baseline(
    path: Path, preset: str, overrides: tuple[str, ...], error: Callable[[str], NoReturn]
) -> tuple[dict[str, Any], float]:
    """The All-Reduce run of an earlier report (``--baseline``), marked with the file and the
    report's command, and the report's link rate; ``error`` (argparse's) if the file is not such a
    report or was made with other settings."""
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as reason:
        error(f"--baseline {path}: cannot read it ({reason})")
    run = report.get("runs", {}).get(BASELINE) if isinstance(report, dict) else None
    if not isinstance(run, dict) or not run.get("curve"):
        error(f"--baseline {path}: no {BASELINE} run with a validation curve in it")
    if (report.get("preset"), tuple(report.get("overrides", ()))) != (preset, overrides):
        error(
            f"--baseline {path}: made with --preset {report.get('preset')} and overrides "
            f"{' '.join(report.get('overrides', ())) or '(none)'}; give the same ones to compare"
        )
    marked = {
        **run,
        "from": str(path),
        "command": report.get("command", "?"),
        "steps": run.get("steps", report.get("steps")),
    }
    return marked, float(report["link"]["rate_mbit"])


def render(argv: Sequence[str]) -> int:
    """``--render JSON [--out-dir DIR]``: write the report again from a run's JSON (numbers unchanged;
    the text and the plot as the current code writes them)."""
    parser = argparse.ArgumentParser(prog="time_to_quality.py --render")
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
    command = shlex.join([".venv/bin/python", "benchmarks/time_to_quality.py", *arguments])
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
    baseline = settings.baseline
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
        "runs": {} if baseline is None else {BASELINE: baseline},
    }
    spec = ClusterSpec(nodes=NODES, rate_mbit=rate, prefix=settings.prefix)
    with EmulatedCluster(spec) as cluster:
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
        for index, name in enumerate(settings.methods):
            method = METHODS[name]
            predicted = predictions(method, calibration, model_cluster)
            logger.info(
                "training %s: %d steps (predicted %.0f ms per step)", method.label, settings.steps,
                predicted["iteration_ms"],
            )  # fmt: skip
            run = settings.work_dir / name
            result = train(cluster, method, settings, run, 29700 + index, logs)
            result["predicted"] = predicted
            result["curve"] = curve(run)
            result["comm_wait_ms"] = comm_wait_ms(run)
            report["runs"][name] = result
            ms = steady_ms_per_iter(result["curve"])
            logger.info("%s: %s ms per step, %.0f s wall", method.label, _fmt(ms), result["wall_seconds"])

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


if __name__ == "__main__":
    sys.exit(main())
