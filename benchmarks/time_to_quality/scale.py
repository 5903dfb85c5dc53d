"""A prediction, not a measurement: each method's time to All-Reduce's quality at 16 and 32 nodes on
the paper's cluster, from the parity grid's simulated steps and ``decentadam.runtime_model``::

    python -m benchmarks.time_to_quality --predict-scale benchmarks/results/parity_scale/runs \\
        --out-dir benchmarks/results/time_to_quality_scale

reads the grid's runs (``python -m benchmarks.parity.scale run`` writes one JSON per method, node
count and seed: ``nodes``, ``ranks_per_node``, ``method``, ``seed``, ``steps``, ``options``,
``curve`` of ``{step, valid_nll}``, ``inter_node_bytes_per_step``) and writes
``time_to_quality_scale.{md,json}``.

1. The steps ratio is the simulation's: the steps a method needs to reach the validation loss of
   All-Reduce with the same nodes and seed at step K, over K (interpolated between evaluations; None
   when it never does within its run). K is the last step both runs reached (an All-Reduce run to
   1,200 steps is the target of a 400-step run at its step 400), or ``--target-step K``: All-Reduce's
   quality at an earlier step, for methods that do not reach its quality at the last one (a run
   shorter than K is left out).
2. The time-per-step ratio is the runtime model's on the paper's cluster (:data:`PAPER`: 32 A40
   GPUs with 25 Gbit/s Ethernet training Transformer-base En-De). The model's two unknowns there,
   the compute C of one iteration and the node links' effective bandwidth, are calibrated so that
   it gives the paper's published iterations, 188.5 ms for All-Reduce and 67.9 ms for AER
   (:func:`calibrate`); S is the float32 parameters of the recipe's ``wmt14-en-de-base`` preset.
   Each grid run's method is priced as its setting builds it (``Setting.schedule``: its topology
   with its exact averages, its nodes, the bytes of its exchange, its second moment); a method whose
   first ``sync_steps`` steps wait for their exchange pays C + communication for those steps.
3. Predicted time to quality = steps to the target x the predicted iteration; its ratio to
   All-Reduce's is (1) x (2). The mean over seeds is reported with each seed's value.

The grid simulates the recipe's small Multi30k model, not Transformer-base: the steps ratios are
carried over to the paper's model as they are, which is the prediction's main assumption.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

from benchmarks.parity.scale import recorded_options
from benchmarks.parity.scale_table import reference, with_rates
from benchmarks.time_to_quality.rates import solve
from decentadam.options import FLAT_OPTIONS, SECOND_MOMENTS, Global, Setting, make_setting
from decentadam.runtime_model import ALLREDUCE, Cluster, Workload, predict, predict_setting
from recipes.translation.compare import time_to_reach

STEM = "time_to_quality_scale"
PARITY_ALLREDUCE = "allreduce"
"""The grid's name of All-Reduce (benchmarks.parity.scale.METHODS)."""


@dataclass(frozen=True)
class PaperCluster:
    """The cluster of the paper's translation runs, and what it published about it."""

    nodes: int = 32
    gpus_per_node: int = 1
    """32 A40 GPUs, read as 32 nodes of one: the layout in which the runtime model gives both published
    iterations (as 8 nodes x 4 or 16 x 2 it cannot: the bandwidth that gives All-Reduce 188.5 ms gives
    AER more than 67.9 ms of communication alone; tests/test_time_to_quality_scale.py checks it)."""
    link_gbit: float = 25.0
    """Ethernet per node and direction; the calibration finds the effective rate."""
    intra_gbit: float = 200.0
    """GPU-to-GPU inside a node, for grid runs of several ranks per node (PCIe 4.0 x16 is about 250
    Gbit/s; A40s have no NVSwitch): assumed, not calibrated."""
    allreduce_ms: float = 188.5
    """All-Reduce's published iteration (Transformer-base En-De)."""
    aer_ms: float = 67.9
    """AER's published iteration."""
    preset: str = "wmt14-en-de-base"
    """The recipe's preset of the paper's model: S from its parameters."""
    forward_fraction: float = 1.0 / 3.0


PAPER = PaperCluster()


def param_bytes(preset: str) -> int:
    """The float32 bytes of the translation recipe's model of ``preset`` (built on the meta device)."""
    import torch

    from recipes.translation import config
    from recipes.translation.model import build_model

    cfg = config.load(preset)
    with torch.device("meta"):
        model = build_model(cfg.data.vocab_size, pad_id=0, eos_id=1, **dataclasses.asdict(cfg.model))
    return 4 * sum(int(p.numel()) for p in model.parameters())


def cluster_of(paper: PaperCluster, nodes: int, ranks_per_node: int, inter_bytes_per_s: float) -> Cluster:
    """``nodes x ranks_per_node`` ranks of the paper's cluster with node links of ``inter_bytes_per_s``."""
    return Cluster(nodes, ranks_per_node, inter_bytes_per_s, paper.intra_gbit * 1e9 / 8)


def _paper_iteration(
    paper: PaperCluster, size: float, method: str, compute_s: float, bandwidth: float
) -> float:
    cluster = cluster_of(paper, paper.nodes, paper.gpus_per_node, bandwidth)
    work = Workload(param_bytes=size, compute_s=compute_s, forward_fraction=paper.forward_fraction)
    return predict(method, cluster, work).iteration_s


@cache
def calibrate(paper: PaperCluster, size: float) -> tuple[float, float]:
    """(C seconds, effective inter-node bytes/s) at which the runtime model gives the paper's
    All-Reduce and AER iterations on its cluster: AER's iteration rises with C, All-Reduce's falls
    with the bandwidth; each is solved for the other's current value until both hold."""

    def aer(compute_s: float, bandwidth: float) -> float:
        return _paper_iteration(paper, size, "aer", compute_s, bandwidth)

    def allreduce(bandwidth: float, compute_s: float) -> float:
        return _paper_iteration(paper, size, ALLREDUCE, compute_s, bandwidth)

    compute_s, bandwidth = paper.aer_ms / 1e3, paper.link_gbit * 1e9 / 8
    for _ in range(50):
        compute_s = solve(partial(aer, bandwidth=bandwidth), paper.aer_ms / 1e3, 1e-4, 10.0, "C (s)")
        at = partial(allreduce, compute_s=compute_s)
        new = solve(at, paper.allreduce_ms / 1e3, 1e6, 1e12, "bandwidth (bytes/s)")
        if abs(new / bandwidth - 1) < 1e-6:
            return compute_s, new
        bandwidth = new
    raise ValueError("the calibration did not settle: the paper's two iterations have no common solution")


def setting_of(record: dict[str, Any]) -> Setting:
    """The setting a grid run ran with: its recorded flat ``options`` on the grid's base
    (:func:`benchmarks.parity.scale.recorded_options`; a second moment written as its repr, e.g.
    ``Global(floored=False)``, as the kind of that name)."""
    flat = {k: v for k, v in recorded_options(record).items() if k in FLAT_OPTIONS}
    moment = flat.get("second_moment")
    if isinstance(moment, str) and moment not in SECOND_MOMENTS:
        kind = next((kind for kind in SECOND_MOMENTS.values() if moment.startswith(kind.__name__)), None)
        if kind is Global:
            flat["second_moment"] = Global(floored="floored=False" not in moment)
        elif kind is not None:
            flat["second_moment"] = kind.name
    return make_setting(**flat)


def iteration_s(
    record: dict[str, Any], paper: PaperCluster, size: float, compute_s: float, bandwidth: float
) -> float:
    """The runtime model's iteration of one grid run's method on ``record['nodes']`` nodes of the
    paper's cluster (ranks per node as the run simulated them): its setting's steady state
    (:func:`decentadam.runtime_model.predict_setting`), its synchronous steps (``sync_steps``)
    counted as compute plus communication."""
    nodes, local = int(record["nodes"]), int(record.get("ranks_per_node", 1))
    cluster = cluster_of(paper, nodes, local, bandwidth)
    work = Workload(param_bytes=size, compute_s=compute_s, forward_fraction=paper.forward_fraction)
    if record["method"] == PARITY_ALLREDUCE or record.get("options") is None:
        return predict(ALLREDUCE, cluster, work).iteration_s
    setting = setting_of(record)
    prediction = predict_setting(setting, cluster, work)
    synchronous = min(setting.sync_steps, int(record["steps"])) / int(record["steps"])
    return (1 - synchronous) * prediction.iteration_s + synchronous * (compute_s + prediction.comm_s)


def load_records(path: Path) -> list[dict[str, Any]]:
    """The grid runs in ``path`` (a JSON file of one run or a list of runs, or a folder of them)."""
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    records: list[dict[str, Any]] = []
    for file in files:
        data = json.loads(file.read_text())
        records += data if isinstance(data, list) else [data]
    missing = [
        r.get("method", "?") for r in records if not {"nodes", "method", "seed", "curve", "steps"} <= set(r)
    ]
    if not records or missing:
        raise ValueError(
            f"{path}: expected benchmarks.parity.scale runs (nodes, method, seed, steps, curve), "
            f"found {len(records)} runs{f', {len(missing)} without those fields' if missing else ''}"
        )
    return with_rates(records)


def target_of(
    record: dict[str, Any], allreduce: dict[str, Any], target_step: int | None
) -> tuple[int, float] | None:
    """(K, All-Reduce's validation loss at step K) for ``record``: K is ``target_step`` or the last step
    both runs reached; None when ``record`` did not run to ``target_step``. ValueError when All-Reduce
    was not evaluated at K."""
    horizon = min(record["curve"][-1]["step"], allreduce["curve"][-1]["step"])
    step = horizon if target_step is None else target_step
    if step > horizon:
        return None
    at = [p["valid_nll"] for p in allreduce["curve"] if p["step"] == step]
    if not at:
        evaluated = ", ".join(str(p["step"]) for p in allreduce["curve"])
        raise ValueError(
            f"All-Reduce at {allreduce['nodes']} nodes, seed {allreduce['seed']} has no evaluation at step "
            f"{step} (it has {evaluated}): give --target-step one of those"
        )
    return step, at[0]


def _row_order(record: dict[str, Any]) -> tuple[int, int, str, float, int]:
    """Rows by layout (nodes, then ranks per node), method and rate; each row's seeds in order."""
    layout = (record["nodes"], record["ranks_per_node"])
    return (*layout, record["method"], record.get("lr") or 0.0, record["seed"])


def predict_scale(
    records: Sequence[dict[str, Any]],
    paper: PaperCluster = PAPER,
    size: float | None = None,
    target_step: int | None = None,
) -> dict[str, Any]:
    """The prediction table: per node count and method, the steps ratio, the predicted iteration and
    its ratio, the predicted time to quality and its ratio to All-Reduce (mean over seeds and each
    seed), and the inter-node bytes per step the grid counted. ``size``: S (default: the preset's);
    ``target_step``: All-Reduce's quality at that step is the target (:func:`target_of`)."""
    size = float(param_bytes(paper.preset)) if size is None else size
    compute_s, bandwidth = calibrate(paper, size)
    layout = [dict(r, ranks_per_node=r.get("ranks_per_node", 1)) for r in records]
    base = reference(layout)  # All-Reduce at its best rate, per ranks and seed
    rows: dict[tuple[int, int, str, float | None], dict[str, Any]] = {}  # one per layout, method, rate
    for record in sorted(layout, key=_row_order):
        ar = base.get((record["nodes"] * record["ranks_per_node"], record["seed"]))
        if record["method"] == PARITY_ALLREDUCE and record is not ar:
            continue  # All-Reduce at another rate than its best
        if ar is None or not ar["curve"] or not record["curve"]:
            continue  # no All-Reduce of the same size and seed: no target
        found = target_of(record, ar, target_step)
        if found is None:
            continue  # this run stopped before the target step
        ar_steps, target = found
        steps = time_to_reach(record["curve"], target, key="step")
        seconds = iteration_s(record, paper, size, compute_s, bandwidth)
        ar_seconds = iteration_s(ar, paper, size, compute_s, bandwidth)
        row = rows.setdefault(
            (record["nodes"], record["ranks_per_node"], record["method"], record.get("lr")),
            {
                "nodes": record["nodes"],
                "ranks_per_node": record["ranks_per_node"],
                "method": record["method"],
                "lr": record.get("lr"),
                "is_default": bool(record.get("is_default")),
                "iteration_ms": seconds * 1e3,
                "iteration_ratio": seconds / ar_seconds,
                "seeds": [],
                "inter_node_bytes_per_step": record.get("inter_node_bytes_per_step"),
            },
        )
        row["seeds"].append(
            {
                "seed": record["seed"],
                "target_step": ar_steps,
                "target_valid_nll": target,
                "steps_to_target": steps,
                "steps_ratio": None if steps is None else steps / ar_steps,
                "time_to_target_s": None if steps is None else steps * seconds,
                "time_ratio": None if steps is None else steps * seconds / (ar_steps * ar_seconds),
            }
        )
    for row in rows.values():
        for field in ("steps_ratio", "time_to_target_s", "time_ratio"):
            values = [s[field] for s in row["seeds"]]
            row[field] = None if None in values else statistics.fmean(values)
    return {
        "paper": dataclasses.asdict(paper),
        "param_bytes": size,
        "calibrated": {"compute_ms": compute_s * 1e3, "inter_gbit": bandwidth * 8 / 1e9},
        "target_step": target_step,
        "rows": list(rows.values()),
    }


def markdown(prediction: dict[str, Any], source: str) -> str:
    """The prediction's page (``source``: where the grid's runs came from), titled as a prediction."""
    paper, cal = prediction["paper"], prediction["calibrated"]

    def cell(value: float | None, spec: str) -> str:
        return "not reached" if value is None else format(value, spec)

    lines = [
        "# Predicted time to quality at scale (the runtime model's, not a measurement)",
        "",
        f"Steps from the parity grid's simulated runs (`{source}`); time per step from "
        f"`decentadam.runtime_model` on the paper's cluster ({paper['nodes'] * paper['gpus_per_node']} A40 "
        f"GPUs read as {paper['nodes']} nodes x {paper['gpus_per_node']}, {paper['link_gbit']:g} Gbit/s "
        f"Ethernet, Transformer-base En-De, S = {prediction['param_bytes'] / 1e6:.0f} MB), calibrated to its "
        f"published {paper['allreduce_ms']:g} ms All-Reduce and {paper['aer_ms']:g} ms AER iterations: C = "
        f"{cal['compute_ms']:.1f} ms, effective node link {cal['inter_gbit']:.1f} Gbit/s (intra-node "
        f"{paper['intra_gbit']:g} Gbit/s assumed). Each grid node is a node of that link with the grid's "
        "ranks per node, each rank one A40.",
        "",
        "Target: "
        + (
            "All-Reduce's validation loss (same nodes and seed) at the last step both runs reached."
            if prediction["target_step"] is None
            else f"All-Reduce's validation loss (same nodes and seed) at step {prediction['target_step']}."
        )
        + " Where All-Reduce ran at several learning rates, the one with the lowest loss at the last step"
        " its runs share."
        + " Steps ratio: the steps a method needs to reach it over All-Reduce's; not reached: not within "
        "the method's run.",
        "",
        "| nodes x ranks | method | lr | steps ratio | predicted ms/step | time-per-step ratio | predicted "
        "time to target s (seeds) | vs All-Reduce | inter-node MB/rank/step (grid) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in prediction["rows"]:
        seeds = "; ".join(cell(s["time_to_target_s"], ".0f") for s in row["seeds"])
        megabytes = row["inter_node_bytes_per_step"]
        lr = "-" if row.get("lr") is None else format(row["lr"], "g")
        lines.append(
            f"| {row['nodes']} x {row.get('ranks_per_node', 1)} "
            f"| {row['method']}{' (default)' if row['is_default'] else ''} | {lr} "
            f"| {cell(row['steps_ratio'], '.2f')} | {row['iteration_ms']:.1f} | {row['iteration_ratio']:.2f} "
            f"| {cell(row['time_to_target_s'], '.0f')} ({seeds}) | {cell(row['time_ratio'], '.2f')} "
            f"| {'-' if megabytes is None else f'{megabytes / 1e6:.1f}'} |"
        )
    return "\n".join([*lines, "", "Every number: `time_to_quality_scale.json`.", ""])


def main(argv: Sequence[str]) -> int:
    """``--predict-scale RUNS [--out-dir DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality --predict-scale")
    parser.add_argument(
        "runs", type=Path, nargs="+", help="benchmarks.parity.scale runs folders or JSON files (one per rate)"
    )
    parser.add_argument(
        "--out-dir", type=Path, help="where time_to_quality_scale.{md,json} go (default: print)"
    )
    parser.add_argument(
        "--target-step", type=int, default=None, metavar="K",
        help="the target is All-Reduce's loss at step K (default: the last step both runs reached)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.target_step is not None and args.target_step <= 0:
        parser.error(
            f"--target-step {args.target_step}: give a positive step at which All-Reduce was evaluated"
        )
    try:
        records = [r for path in args.runs for r in load_records(path)]
        prediction = predict_scale(records, target_step=args.target_step)
    except (OSError, json.JSONDecodeError, ValueError) as error:
        parser.error(f"{' '.join(map(str, args.runs))}: {error}")
    text = markdown(prediction, ", ".join(map(str, args.runs)))
    if args.out_dir is None:
        print(text)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{STEM}.md").write_text(text)
    (args.out_dir / f"{STEM}.json").write_text(json.dumps(prediction, indent=2) + "\n")
    print(f"wrote {args.out_dir / f'{STEM}.md'} and .json")
    return 0
