"""The command line of the runtime model: ``python -m decentadam.runtime_model --help``.

Reads a cluster and a workload from flags, prints the predicted iteration time of All-Reduce and of
DecentralizedAdam on every topology (:func:`decentadam.runtime_model.model.predict_setting`), and
which to use. The options of DecentralizedAdam's rows default to its default setting
(``decentadam.Setting()``): without them, the row of its topology is ``DecentralizedAdam(params)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from decentadam.options import EXCHANGES, INTRA_NODE, SECOND_MOMENTS, Setting, make_setting
from decentadam.runtime_model.model import (
    ALLREDUCE,
    METHODS,
    Cluster,
    Prediction,
    Workload,
    predict,
    predict_setting,
    workload_of,
)

__all__ = ["build_parser", "main", "parse_size", "recommend"]

_SUFFIXES = MappingProxyType({"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12})


def parse_size(text: str, option: str = "value") -> float:
    """``"350M"`` -> 3.5e8 (suffixes K, M, G, T are powers of 1000, case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)\s*", text)
    if match is None:
        raise ValueError(f"{option} {text}: expected a number with optional K/M/G suffix")
    return float(match.group(1)) * _SUFFIXES[match.group(2).upper()]


def _size_arg(option: str) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            return parse_size(text, option)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _number(text: str, kind: type[float] | type[int], least: float, strict: bool) -> float:
    """``text`` as ``kind`` (finite, > ``least`` if ``strict`` else >= it), or an argparse error."""
    noun = "a whole number" if kind is int else "a number"
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
    if not (value > least if strict else value >= least) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected {noun} {'>' if strict else '>='} {least:g}, got {text}")
    return value


def _positive(text: str) -> float:
    return _number(text, float, 0, strict=True)


def _non_negative(text: str) -> float:
    return _number(text, float, 0, strict=False)


def _count(text: str) -> int:
    return int(_number(text, int, 1, strict=False))


def _count_or_zero(text: str) -> int:
    return int(_number(text, int, 0, strict=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decentadam.runtime_model",
        description="Predict per-iteration time of All-Reduce vs DecentralizedAdam topologies.",
    )
    parser.add_argument(
        "--params", type=_size_arg("--params"), required=True, help="parameter count, e.g. 350M"
    )
    parser.add_argument(
        "--bytes-per-param", type=_positive, default=4.0, help="4 for fp32 (default), 2 for bf16"
    )
    parser.add_argument(
        "--compute-ms", type=_non_negative, required=True, help="forward+backward time per rank"
    )
    parser.add_argument(
        "--forward-fraction", type=float, default=1.0 / 3.0, help="share of compute in forward"
    )
    parser.add_argument("--nodes", type=_count, required=True)
    parser.add_argument("--gpus-per-node", type=_count, default=1, help="ranks per node (default 1)")
    parser.add_argument("--inter-gbps", type=_positive, required=True, help="node link, Gbit/s per direction")
    parser.add_argument(
        "--intra-gbps", type=_positive, default=800.0, help="rank-to-rank inside a node (NVLink ~800)"
    )
    parser.add_argument("--inter-latency-us", type=_non_negative, default=20.0)
    parser.add_argument("--intra-latency-us", type=_non_negative, default=5.0)
    parser.add_argument(
        "--update-ms", type=_non_negative, default=0.0, help="DecentralizedAdam step time (measure it)"
    )
    parser.add_argument(
        "--allreduce-update-ms",
        type=_non_negative,
        default=None,
        help="AdamW step time (default: --update-ms)",
    )
    parser.add_argument(
        "--bucket-mb", type=_positive, default=25.0, help="bucket size (DDP and DecentralizedAdam)"
    )
    parser.add_argument("--overlap", choices=("step", "backward"), default="step", help="Comm(overlap=...)")
    parser.add_argument(
        "--update-blocks-comm",
        action="store_true",
        help="the optimizer step and communication share saturated CPU cores (gloo on CPU)",
    )
    parser.add_argument(
        "--hierarchical",
        action="store_true",
        help="multi-node groups summed in three phases (DecentralizedAdam on gloo; NCCL: flat rings)",
    )
    parser.add_argument(
        "--v-every",
        type=_count,
        default=None,
        help="second_moment='group_gradient': a gradient sum with the parameters every K steps "
        "(bfloat16 in a pair, float32 in a larger group)",
    )
    parser.add_argument(
        "--share-second-moment-every",
        type=_count_or_zero,
        default=0,
        help="GroupGradient(share_second_moment_every=K), with --intra-node all_reduce and "
        "--second-moment group_gradient: the node's second moment (bfloat16) with every K-th exchange "
        "(default 0: not shared)",
    )
    default = Setting()
    parser.add_argument(
        "--second-moment",
        choices=tuple(SECOND_MOMENTS),
        help="Setting(second_moment=...) (default: group_gradient with --v-every, else the default "
        f"setting's, {default.second_moment.name}); with --intra-node all_reduce, group_gradient adds "
        "the squares to the node's sum; global sends each rank's estimate with every exact average",
    )
    parser.add_argument(
        "--exchange",
        choices=EXCHANGES,
        default=default.exchange,
        help=f"Setting(exchange=...) (default {default.exchange}): 'bf16_updates' sends each rank's update "
        "in bfloat16 (2 bytes per parameter) in place of its parameters",
    )
    parser.add_argument(
        "--intra-node",
        choices=INTRA_NODE,
        default=default.intra_node,
        help=f"Setting(intra_node=...) (default {default.intra_node}): 'all_reduce' all-reduces the "
        "gradients (and with --second-moment group_gradient their squares) inside each node before "
        "every update, and only nodes gossip",
    )
    parser.add_argument(
        "--average-every",
        type=_count_or_zero,
        default=default.average_every,
        help=f"Setting(average_every=...) (default {default.average_every}): every K-th step the "
        "exchange is the exact average over all ranks; 0: never",
    )
    parser.add_argument(
        "--straggler",
        type=_positive,
        default=1.0,
        help="one rank's compute is this many times slower (default 1)",
    )
    return parser


def _format_table(predictions: list[Prediction]) -> str:
    base = next((p for p in predictions if p.method == ALLREDUCE), None)
    header = (
        "| method | iteration ms | lower bound ms | comm ms | inter-node MB/rank/iter "
        "| speed-up vs all-reduce |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|"]
    for p in predictions:
        speedup = f"{base.iteration_s / p.iteration_s:.2f}x" if base is not None else "-"
        lines.append(
            f"| {p.method} | {p.iteration_s * 1e3:.1f} | {p.lower_bound_s * 1e3:.1f} | {p.comm_s * 1e3:.1f} "
            f"| {p.inter_bytes_per_rank / 1e6:.1f} | {speedup} |"
        )
    return "\n".join(lines)


TIE = 1.02
"""Iteration times within this factor count as equal in :func:`recommend`."""


def setting_call(setting: Setting) -> str:
    """How a user writes ``setting``: ``DecentralizedAdam(params)`` for the default, else the fields
    that differ from it, by the names ``make_setting`` takes."""
    default = Setting().flat()
    changed = {k: v for k, v in setting.flat().items() if v is not None and v != default[k]}
    if not changed:
        return "DecentralizedAdam(params) (the default setting)"
    arguments = ", ".join(f"{k}={v!r}" for k, v in changed.items())
    return f"DecentralizedAdam(params, setting=make_setting({arguments}))"


def recommend(predictions: list[Prediction], settings: Mapping[str, Setting], threshold: float = 1.10) -> str:
    """One sentence: the fastest method, and whether decentralizing is worth it (>= ``threshold``x).

    ``settings``: the Setting each gossip prediction was made with, by its method's name. The
    default setting's row wins over one at most ``TIE`` times faster.
    """
    base = next(p for p in predictions if p.method == ALLREDUCE)
    gossip = [p for p in predictions if p.method != ALLREDUCE]
    if not gossip:
        return "Use All-Reduce: no gossip topology can be built for this cluster."
    best = min(gossip, key=lambda p: p.iteration_s)
    default = next((p for p in gossip if settings[p.method] == Setting()), None)
    if default is not None and default.iteration_s <= best.iteration_s * TIE:
        best = default  # as fast: the setting whose quality at scale was measured
    speedup = base.iteration_s / best.iteration_s
    if speedup >= threshold:
        advice = f"Use {setting_call(settings[best.method])}: predicted {speedup:.2f}x faster per iteration"
        if default is not None and default is not best:  # the quality at scale was measured for it
            ratio = base.iteration_s / default.iteration_s
            advice += (
                f" ({default.method}, the default setting's graph, {ratio:.2f}x; "
                "the steps each needs for All-Reduce's quality are not in this model: docs/choosing.md)"
            )
        return advice + "."
    return (
        f"Use All-Reduce: the best topology ({best.method}) is predicted only {speedup:.2f}x faster per "
        "iteration, not worth the consensus error of decentralized training."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.second_moment is None:
        args.second_moment = "group_gradient" if args.v_every is not None else Setting().second_moment.name
    try:  # the options' own rules (decentadam.options), as DecentralizedAdam would apply them
        options = make_setting(
            second_moment=args.second_moment,
            v_every=args.v_every,
            share_second_moment_every=args.share_second_moment_every,
            intra_node=args.intra_node,
            exchange=args.exchange,
            average_every=args.average_every,
        )
    except ValueError as error:
        parser.error(str(error))
    try:
        cluster, work = _inputs(args)
    except ValueError as error:
        parser.error(str(error))
    predictions = [predict(ALLREDUCE, cluster, work)]
    settings: dict[str, Setting] = {}
    skipped: dict[str, str] = {}
    for name in METHODS[1:]:
        setting = dataclasses.replace(options, topology=name)
        try:
            prediction = predict_setting(setting, cluster, work, values=args.params)
        except ValueError as error:
            skipped[name] = str(error).split(":")[0]
            continue
        predictions.append(dataclasses.replace(prediction, method=name))
        settings[name] = setting
    print(
        f"{args.params:.3g} parameters ({work.param_bytes / 1e6:.0f} MB), compute {args.compute_ms:g} ms, "
        f"{args.nodes} nodes x {args.gpus_per_node} ranks, inter-node {args.inter_gbps:g} Gbit/s, "
        f"intra-node {args.intra_gbps:g} Gbit/s"
        + (f", one rank {args.straggler:g}x slower" if args.straggler != 1.0 else "")
    )
    neutral = {"accum_steps": 1, "sync_steps": 0}
    flat = {
        k: v
        for k, v in options.flat().items()
        if v is not None and k != "topology" and (k not in neutral or v != neutral[k])
    }
    print("DecentralizedAdam's rows: each topology with " + ", ".join(f"{k}={v!r}" for k, v in flat.items()))
    print(_format_table(predictions))
    node_sums = [p.node_sum_s for p in predictions if p.node_sum_s]
    if args.intra_node == "all_reduce" and node_sums:
        node_work = workload_of(options, work, args.params)
        what = "gradients and their squares" if node_work.node_squares else "gradients"
        print(
            f"intra_node='all_reduce' (the topologies' rows): every step each node all-reduces "
            f"{node_work.node_sum_bytes() / 1e6:.0f} MB ({what}) in "
            f"{node_sums[0] * 1e3:.1f} ms before updating, and the topologies are built among the "
            f"{args.nodes} nodes"
        )
    for name, reason in skipped.items():
        print(f"not buildable: {name} ({reason})")
    print(recommend(predictions, settings))
    return 0


def _inputs(args: argparse.Namespace) -> tuple[Cluster, Workload]:
    cluster = Cluster(
        nodes=args.nodes,
        ranks_per_node=args.gpus_per_node,
        inter_bytes_per_s=args.inter_gbps * 1e9 / 8,
        intra_bytes_per_s=args.intra_gbps * 1e9 / 8,
        inter_latency_s=args.inter_latency_us * 1e-6,
        intra_latency_s=args.intra_latency_us * 1e-6,
    )
    n = cluster.world_size
    scale = (args.straggler,) + (1.0,) * (n - 1) if args.straggler != 1.0 else ()
    update = args.update_ms * 1e-3
    work = Workload(
        param_bytes=args.params * args.bytes_per_param,
        compute_s=args.compute_ms * 1e-3,
        forward_fraction=args.forward_fraction,
        update_s=update,
        allreduce_update_s=update if args.allreduce_update_ms is None else args.allreduce_update_ms * 1e-3,
        bucket_bytes=args.bucket_mb * 2**20,
        overlap=args.overlap,
        update_overlaps_comm=not args.update_blocks_comm,
        compute_scale=scale,
        hierarchical=args.hierarchical,
    )
    return cluster, work
