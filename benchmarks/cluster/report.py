"""Markdown + PNG + JSON report of one cluster benchmark run (written by ``benchmarks.cluster.run``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.cluster.cases import BenchConfig, Outcome
from benchmarks.thresholds import CLUSTER_AER_RATIO, CLUSTER_BOUND_RATIO, MODEL_TOLERANCE


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(outcomes: Sequence[Outcome], baseline: Outcome | None) -> list[str]:
    lines = [
        "| configuration | mean ms | runs' means ms | median ms | p90 ms | comm wait ms/iter "
        "| update ms/iter "
        "| inter-node MB/rank/iter (tc) | predicted inter-node MB | buffer MB/rank/iter "
        "| predicted ms, overlapped | error | predicted ms, serialized | error | lower bound ms "
        "| vs All-Reduce | host CPU busy |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        versus = f"{o.mean_ms / baseline.mean_ms:.2f}x" if baseline is not None else "-"
        lines.append(
            f"| {o.case.label} | {o.mean_ms:.0f} | {_runs(o)} | {o.median_ms:.0f} | {o.p90_ms:.0f} "
            f"| {o.wait_ms:.0f} "
            f"| {o.update_ms:.0f} | {o.inter_mb_per_rank:.1f} | {o.predicted_inter_mb:.1f} "
            f"| {_fmt(o.buffer_mb_per_rank, 1)} | {o.predicted_ms:.0f} | {o.error * 100:+.1f}% "
            f"| {o.predicted_serial_ms:.0f} | {o.serial_error * 100:+.1f}% | {o.lower_bound_ms:.0f} "
            f"| {versus} | {_percent(o.cpu_busy)} |"
        )
    return lines


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _runs(o: Outcome) -> str:
    return ", ".join(f"{m:.0f}" for m in o.run_means_ms)


def _ratios(numerator: Outcome, denominator: Outcome) -> list[float]:
    """Per-run ratios, paired by repeat (both ran in the same round of configurations)."""
    pairs = zip(numerator.run_means_ms, denominator.run_means_ms, strict=True)
    return [a / b for a, b in pairs]


def _updates(config: BenchConfig) -> str:
    if config.update_ms_per_mb <= 0:
        return "real optimizer steps on the CPU"
    return (
        f"optimizer arithmetic emulated by sleeps of {config.update_ms_per_mb:.4f} ms per MB "
        f"({config.update_ms_per_mb * config.param_mb:.2f} ms per step for S; an H100's AccumAdamW), "
        "DecentralizedAdam's mixing and buffer copies, decent-dp's mixing and copies and DDP's "
        "gradient buckets real"
    )


def _alone_section(alone: dict[str, dict[str, float]]) -> list[str]:
    if not alone:
        return []
    lines = [
        "## Exchanges alone (no compute, no update)",
        "",
        "Each decentadam topology's group sums of the bucketed parameters, step after step, with "
        "nothing else running (`worker.py` method `exchange`: C = 0, no optimizer, hierarchical sums; "
        "measured before the configurations). Predicted: the runtime model from the inputs above with "
        "C = 0 and U = 0, i.e. its communication term alone.",
        "",
        "| topology | measured ms/step | predicted ms/step | error | host CPU busy |",
        "|---|---:|---:|---:|---:|",
    ]
    for topology, row in alone.items():
        error = row["predicted_ms"] / row["measured_ms"] - 1.0
        lines.append(
            f"| {topology} | {row['measured_ms']:.0f} | {row['predicted_ms']:.0f} | {error * 100:+.1f}% "
            f"| {_percent(row['cpu_busy'])} |"
        )
    return [*lines, ""]


def _find(
    outcomes: Sequence[Outcome], library: str, topology: str, straggler: bool, overlap: str = "step"
) -> Outcome | None:
    for o in outcomes:
        case = o.case
        wanted = (library, topology, straggler, overlap)
        if (case.library, case.topology, case.straggler, case.overlap) == wanted and case.hierarchical:
            return o
    return None


def write_report(
    out_dir: Path,
    config: BenchConfig,
    command: str,
    probes: dict[str, dict[str, Any]],
    calibration: dict[str, float],
    outcomes: list[Outcome],
    elapsed_s: float,
    machine: dict[str, str],
    spec_summary: dict[str, Any],
    alone: dict[str, dict[str, float]] | None = None,
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / config.name
    md, png, raw = stem.with_suffix(".md"), stem.with_suffix(".png"), stem.with_suffix(".json")
    steady = [o for o in outcomes if not o.case.straggler]
    slow = [o for o in outcomes if o.case.straggler]
    ar = _find(outcomes, "torch DDP", "all-reduce", False)
    aer = _find(outcomes, "decentadam", "aer", False)

    lines = [
        f"# Emulated cluster: {config.nodes} nodes x {config.ranks_per_node} ranks, "
        f"{config.rate_mbit:g} Mbit/s node links",
        "",
        f"- command: `{command}` (as root; run under `flock /tmp/decentadam-cpu.lock`)",
        f"- date: {machine['date']}; wall time {elapsed_s / 60:.1f} min",
        f"- machine: {machine['cpu']}, {machine['cores']} cores, kernel {machine['kernel']}, Python "
        f"{machine['python']}, torch {machine['torch']}; load average at end: {machine['load']}",
        f"- workload per rank and iteration: S = {config.param_mb:g} MB of fp32 parameters in "
        f"{config.layers} tensors; compute C = {config.compute_ms:g} ms emulated by sleeps "
        "(1/3 forward, 2/3 backward, spread over the layers so gradients become ready during "
        f"backward); {_updates(config)}; "
        f"buckets {config.bucket_mb:g} MB; OMP_NUM_THREADS=1 per rank",
        f"- iterations: {config.warmup} warm-up, then {config.iters} measured (a multiple of every "
        "topology period); mean = (end of last - start) / iterations, averaged over ranks; median/p90 "
        "over all ranks' per-iteration times"
        + (
            f"; every configuration ran {config.repeats} times, one round of all configurations after "
            "another: mean = the mean of the runs' means (listed), median/p90 over all runs' iterations, "
            "the other columns averaged over runs"
            if config.repeats > 1
            else ""
        ),
        f"- network: namespaces `{spec_summary['prefix']}-n0..n{config.nodes - 1}` on a bridge in "
        f"`{spec_summary['prefix']}-sw`, tbf {config.rate_mbit:g} Mbit/s on both ends of every node link "
        "(full duplex), MTU 1500; ranks bind to eth0 (GLOO_SOCKET_IFNAME), so same-node peers talk over lo",
        "- methods: torch DDP (gloo, AdamW foreach); decentadam DecentralizedAdam(accum_steps=4, "
        "overlap='step', and for aer also overlap='backward': updates from backward hooks; groups that "
        "span nodes summed hierarchically, the gloo default: reduce-scatter in the node, all-reduce of "
        "the shards across nodes, all-gather; 'flat rings' is the same AER with one gloo all-reduce per "
        "group, as before); decent-dp "
        "0.2.3 DecentralizedDataParallel + its AccumAdamW(accum_iter=4) (the `bench` extra; "
        "its AER is `alternating-exp-ring`)",
        "",
        "## Inputs of the runtime model (measured here, before and apart from the configurations)",
        "",
        "| measurement | value | tbf bytes moved |",
        "|---|---:|---:|",
        f"| TCP node 0 -> node 1 (one stream, {probes['inter']['bytes'] / 1e6:.0f} MB) "
        f"| {probes['inter']['bytes_per_s'] / 1e6:.1f} MB/s | {probes['inter']['tbf_bytes']:,} |",
        f"| TCP node 0 <-> node 1 (one stream each way at once), per stream: B_inter "
        f"| {probes['duplex']['bytes_per_s'] / 1e6:.1f} MB/s | {probes['duplex']['tbf_bytes']:,} |",
        f"| TCP inside every node at once ({probes['intra']['streams']} loopback streams, "
        f"{probes['intra']['bytes'] / 1e6:.0f} MB), per stream "
        f"| {probes['intra']['bytes_per_s'] / 1e6:.1f} MB/s | {probes['intra']['tbf_bytes']:,} |",
    ]
    names = {
        "adamw_s": "DDP's optimizer step (AdamW, or its emulation), all ranks at once",
        "ours_update_s": "DecentralizedAdam step, no network (mix + update + copy), all ranks at once",
        "decent_dp_update_s": "decent-dp bucket update (mix + its update + copy), all ranks at once",
        "intra_allreduce_s": "gloo all-reduce of S inside every node at once (over lo)",
    }
    for key, value in calibration.items():
        if key == "intra_bytes_per_s":
            lines.append(
                "| B_intra used by the model: ring bytes / gloo intra-node all-reduce time "
                f"| {value / 1e6:.1f} MB/s | - |"
            )
        else:
            lines.append(f"| {names.get(key, key)} | {value * 1e3:.0f} ms | - |")
    lines += [
        "",
        "The inter-node probe moves its bytes (plus ~4.5% TCP/IP/Ethernet headers) through the tbf "
        "qdiscs; the same-node probes move (almost) none through them: intra-node traffic avoids the "
        "shaping, inter-node traffic goes through it. The model uses the two-way probe's per-stream "
        "payload rate as B_inter (in every configuration here a node link carries data both ways at "
        "once, and each direction also carries the other stream's ACKs), B_intra from gloo's "
        "intra-node all-reduce (the Python probe is CPU-bound and only "
        "shows the path), latency 0, and the calibrated step times as U "
        "(`decentadam/runtime_model/model.py` documents the formulas).",
        "",
        *_alone_section(alone or {}),
        "## Results",
        "",
        "comm wait: decentadam = time blocked in `wait()` for exchanges (CommStats.wait_seconds); DDP and "
        "decent-dp = backward wall time minus the emulated backward (for decent-dp this includes its "
        "updates, which run inside backward hooks). update: time in `optimizer.step()` minus waiting. "
        "inter-node MB: bytes through the nodes' uplink tbf (tc counters, headers included) / ranks / "
        "iterations. buffer MB: CommStats.bytes_sent / iterations (parameter bytes entering group sums). "
        "error = predicted / measured mean - 1. Two predictions from the same inputs: *overlapped* is "
        "the runtime model as for a real cluster (a bucket's exchange travels while later buckets are "
        "updated, the `update_overlaps_comm=True` default); *serialized* assumes the update and the "
        f"communication cannot share this machine's {machine['cores']} cores, which "
        f"{config.world_size} ranks' optimizer steps saturate "
        "(`update_overlaps_comm=False`). For All-Reduce they coincide (DDP's step needs every reduced "
        "gradient).",
        "",
        *_table(steady, ar),
        "",
    ]
    if ar is not None and aer is not None:
        hooks = _find(outcomes, "decentadam", "aer", False, "backward")
        ratio = aer.mean_ms / ar.mean_ms
        bound = aer.mean_ms / aer.lower_bound_ms
        worst = max(outcomes, key=lambda o: abs(o.error))
        worst_serial = max(outcomes, key=lambda o: abs(o.serial_error))
        worst_band = max(outcomes, key=lambda o: abs(o.band_error))
        inside = sum(1 for o in outcomes if o.band_error == 0.0)
        runs = len(aer.run_means_ms)
        per_run = ", ".join(f"{r:.2f}x" for r in _ratios(aer, ar))
        per_run_bound = ", ".join(f"{m / aer.lower_bound_ms:.2f}x" for m in aer.run_means_ms)
        over = f"mean of {runs} runs" if runs > 1 else "one run"
        lines += [
            "## Targets",
            "",
            f"- AER vs All-Reduce per-iteration time ({over}): "
            f"{aer.mean_ms:.0f} ms vs {ar.mean_ms:.0f} ms = "
            f"**{ratio:.2f}x** (target <= {CLUSTER_AER_RATIO}x): "
            f"{'PASS' if ratio <= CLUSTER_AER_RATIO else 'MISS'}; run by run (paired by round): {per_run}",
            f"- AER vs the model's lower bound max(C, comm) (the recursion with free optimizer steps, "
            f"{aer.lower_bound_ms:.0f} ms): **{bound:.2f}x** (target <= {CLUSTER_BOUND_RATIO}x): "
            f"{'PASS' if bound <= CLUSTER_BOUND_RATIO else 'MISS'}; run by run: {per_run_bound}",
            *(
                [
                    f"- AER's exchanges alone (no compute, no update; section above) take "
                    f"{alone['aer']['measured_ms']:.0f} ms per step: "
                    f"{alone['aer']['measured_ms'] / aer.lower_bound_ms:.2f}x that bound before any "
                    "training work shares the cores"
                ]
                if alone and "aer" in alone
                else []
            ),
            *(
                [
                    f"- the machine's {machine['cores']} cores were {aer.cpu_busy:.0%} busy during AER's "
                    f"measured iterations ({ar.cpu_busy:.0%} during All-Reduce's; /proc/stat, idle and "
                    "iowait counted as not busy)"
                ]
                if aer.cpu_busy is not None and ar.cpu_busy is not None
                else []
            ),
            *(
                [
                    f"- the same for AER with `overlap='backward'` (updates from backward hooks): "
                    f"{hooks.mean_ms:.0f} ms = **{hooks.mean_ms / ar.mean_ms:.2f}x** All-Reduce "
                    f"({'PASS' if hooks.mean_ms / ar.mean_ms <= CLUSTER_AER_RATIO else 'MISS'}; run by run: "
                    + ", ".join(f"{r:.2f}x" for r in _ratios(hooks, ar))
                    + f") and **{hooks.mean_ms / hooks.lower_bound_ms:.2f}x** its lower bound "
                    f"({'PASS' if hooks.mean_ms / hooks.lower_bound_ms <= CLUSTER_BOUND_RATIO else 'MISS'})"
                ]
                if hooks is not None
                else []
            ),
            f"- time in the optimizer step (update ms/iter, waiting excluded): {ar.update_ms:.0f} ms for "
            f"DDP, {aer.update_ms:.0f} ms for AER's mix + update + copy. "
            + (
                "Here the updates are emulated at a GPU's speed, so what is left of them is the real "
                f"mixing and copying of {config.world_size} ranks' buffers on the shared cores."
                if config.update_ms_per_mb > 0
                else f"On this machine {config.world_size} ranks share {machine['cores']} cores, so "
                "these real CPU updates are a fixed cost that neither overlap nor topology removes. "
                "Without them (measured mean minus measured update time; on a real cluster every rank "
                f"steps on its own device): All-Reduce {ar.mean_ms - ar.update_ms:.0f} ms, AER "
                f"{aer.mean_ms - aer.update_ms:.0f} ms = "
                f"{(aer.mean_ms - aer.update_ms) / (ar.mean_ms - ar.update_ms):.2f}x"
            )
            + f" The model's lower bounds give {aer.lower_bound_ms / ar.lower_bound_ms:.2f}x",
            f"- model within {MODEL_TOLERANCE:.0%} of the measurement in every configuration: "
            f"overlapped model {'PASS' if abs(worst.error) <= MODEL_TOLERANCE else 'MISS'} (worst: "
            f"{worst.case.label}, {worst.error * 100:+.1f}%); serialized model "
            f"{'PASS' if abs(worst_serial.serial_error) <= MODEL_TOLERANCE else 'MISS'} (worst: "
            f"{worst_serial.case.label}, {worst_serial.serial_error * 100:+.1f}%). The measurement lies "
            f"between the two in {inside} of {len(outcomes)} configurations; the largest distance to the "
            f"band is {worst_band.band_error * 100:+.1f}% ({worst_band.case.label})",
            "",
        ]
    if slow:
        lines += [
            f"## Stragglers: rank {config.straggler_rank} computes {config.straggler_factor:g}x slower",
            "",
            *_table(slow, _find(outcomes, "torch DDP", "all-reduce", True)),
            "",
            "| configuration | without straggler ms | with straggler ms | slow-down |",
            "|---|---:|---:|---:|",
        ]
        for o in slow:
            base = _find(outcomes, o.case.library, o.case.topology, False, o.case.overlap)
            if base is not None:
                lines.append(
                    f"| {base.case.label} | {base.mean_ms:.0f} | {o.mean_ms:.0f} "
                    f"| {o.mean_ms / base.mean_ms:.2f}x |"
                )
        lines.append("")
    peers = [o for o in steady if o.case.library == "decent-dp"]
    if peers:
        lines += [
            "## decentadam vs decent-dp 0.2.3 (same topology, same workload)",
            "",
            "| topology | decentadam mean ms | decent-dp mean ms | decentadam / decent-dp "
            "| run by run | decentadam, backward hooks, mean ms | backward hooks / decent-dp |",
            "|---|---:|---:|---:|---|---:|---:|",
        ]
        for peer in [o for o in outcomes if o.case.library == "decent-dp"]:
            ours = _find(outcomes, "decentadam", peer.case.topology, peer.case.straggler)
            hooks = _find(outcomes, "decentadam", peer.case.topology, peer.case.straggler, "backward")
            if ours is not None:
                tag = " +straggler" if peer.case.straggler else ""
                hooks_cells = (
                    f"{hooks.mean_ms:.0f} | {hooks.mean_ms / peer.mean_ms:.2f}x" if hooks else "- | -"
                )
                lines.append(
                    f"| {peer.case.topology}{tag} | {ours.mean_ms:.0f} | {peer.mean_ms:.0f} "
                    f"| {ours.mean_ms / peer.mean_ms:.2f}x "
                    f"| {', '.join(f'{r:.2f}x' for r in _ratios(ours, peer))} | {hooks_cells} |"
                )
        lines.append("")
    lines += [f"![measured vs predicted]({png.name})", ""]
    md.write_text("\n".join(lines))
    _plot(png, config, outcomes)
    raw.write_text(
        json.dumps(
            {
                "config": asdict(config),
                "command": command,
                "machine": machine,
                "probes": probes,
                "calibration": calibration,
                "exchange_alone": alone or {},
                "outcomes": [
                    {**{k: v for k, v in asdict(o).items() if k != "raw"}, "runs": o.raw["runs"]}
                    for o in outcomes
                ],
            },
            indent=1,
        )
    )
    return [md, png, raw]


def _plot(path: Path, config: BenchConfig, outcomes: list[Outcome]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(outcomes)), 4.8))
    xs = list(range(len(outcomes)))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [o.mean_ms for o in outcomes], width, label="measured (mean)")
    ax.errorbar(
        [x - width / 2 for x in xs],
        [o.median_ms for o in outcomes],
        yerr=[[0.0] * len(outcomes), [max(0.0, o.p90_ms - o.median_ms) for o in outcomes]],
        fmt="k.",
        label="median .. p90",
    )
    ax.bar([x + width / 2 for x in xs], [o.predicted_ms for o in outcomes], width, label="runtime model")
    ax.plot(
        [x + width / 2 for x in xs], [o.lower_bound_ms for o in outcomes], "r_", ms=14, label="lower bound"
    )
    ax.set_xticks(xs)
    ax.set_xticklabels([o.case.label for o in outcomes], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("ms per iteration")
    ax.set_title(
        f"{config.nodes} nodes x {config.ranks_per_node} ranks, {config.rate_mbit:g} Mbit/s, "
        f"S = {config.param_mb:g} MB, C = {config.compute_ms:g} ms"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
