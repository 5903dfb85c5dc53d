"""Parity at scale: the gap to All-Reduce on 4-32 nodes at a fixed global batch, with each method's bytes.

One run is one cell of the grid: the translation recipe's model and data (Multi30k En-De, 4,096
target tokens per step) on ``nodes x ranks_per_node`` simulated ranks in one process
(:mod:`benchmarks.parity.workers`: the library's own update and mixing code through
:class:`decentadam.simulation.SimulatedCluster`), one method, one seed. Every exchange a rank
starts passes through a counter that prices it as the inter-node traffic of an all-reduce over
its group (a group spanning ``g`` nodes moves ``2 (g - 1) / g`` times its buffer across nodes,
shared by the group's ranks on each node), so each run records the inter-node bytes per rank and
step, averaged over the run, and how often a step's exchange spans every node::

    python -m benchmarks.parity.scale run --data MULTI30K --nodes 16 --method default --seed 1 \\
        --steps 400 --out benchmarks/results/parity_scale/runs

writes ``OUT/METHOD-n16x1-s1.json`` with ``nodes``, ``ranks_per_node``, ``tokens_per_rank``,
``method``, ``is_default``, ``seed``, ``steps``, ``inter_node_bytes_per_step``,
``ddp_bf16_bytes_per_step`` (``2 (N - 1) / N x S / 2``, a ring all-reduce of bfloat16 gradients
over the ``N`` nodes; ``S``: float32 parameter bytes; for nodes of ``L`` ranks both are per rank,
a node's share divided by ``L``), ``global_collectives_per_step``, ``command``, ``code`` (the
commit), ``lr`` and ``curve`` (valid NLL of the ranks' exact average). ``table`` writes the grid's
page from folders of runs (one folder per learning rate: a run's file name does not hold it)::

    python -m benchmarks.parity.scale table --out benchmarks/results/parity_scale/README.md \\
        benchmarks/results/parity_scale/{runs,lr-5e-4,lr-1e-3,lr-4e-3,probes}
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from benchmarks.gossip import PLAIN
from benchmarks.parity.scale_table import DEFAULT
from decentadam.collectives import Handle
from decentadam.options import Global
from decentadam.topology import Group

ALWAYS = 10**9
"""sync_steps that covers a whole run: every step waits for its exchange and mixes before returning."""


GRID_BASE: dict[str, Any] = {"topology": "aer", "sync_steps": 0} | {
    name: value for name, value in PLAIN.items() if name != "intra_node"
}
"""What every other method starts from: plain gossip on aer (:mod:`benchmarks.gossip`, the library's
default when the grid began, the method ``aer-all-ranks``), so that a method's name keeps meaning
what its committed runs ran whatever the default becomes. ``intra_node`` comes from the layout
(:func:`method_options`)."""


@dataclass(frozen=True)
class Method:
    """A row of the grid: DecentralizedAdam's options, flat as the recipe's ``[optim]`` names them
    (``decentadam.make_setting``; None: All-Reduce), and what it is."""

    options: dict[str, Any] | None
    about: str
    nodes_of_one: bool = True  # whether it runs on single-rank nodes
    accum: Callable[[int], int] | None = field(default=None)  # accum_steps from the node count


def accum_window(nodes: int) -> int:
    """The paper's AccumAdam window: 4 up to 8 workers, 8 for 16-32 (decentdp poster)."""
    return 4 if nodes <= 8 else 8


METHODS: dict[str, Method] = {
    "allreduce": Method(None, "All-Reduce: DDP + AdamW on the mean gradient"),
    DEFAULT: Method({}, "DecentralizedAdam() as committed: its defaults, nothing passed"),
    "aer-all-ranks": Method(
        {"intra_node": "gossip"},
        "all_ranks on aer, float32 parameters, every rank a worker of the graph: DecentralizedAdam()'s "
        "default until the overlapped candidate (exp-avg32-global) replaced it",
    ),
    "accumadam": Method(
        {"second_moment": "local", "topology": "aer"},
        "the paper's AccumAdam on aer: own second moment, window 4 (N <= 8) or 8",
        accum=accum_window,
    ),
    "chosen-aer": Method(
        {
            "intra_node": "all_reduce",
            "second_moment": "group_gradient",
            "share_second_moment_every": 2,
            "topology": "aer",
        },
        "the 2-node chosen setting on aer (float32 parameters: bf16 updates need fixed groups there; "
        "its synchronous warm-up cannot be simulated)",
        nodes_of_one=False,
    ),
    "exp": Method({"topology": "one-peer-exp"}, "all_ranks on one-peer-exp (float32 parameters)"),
    "exp-avg16": Method(
        {"topology": "one-peer-exp", "exchange": "bf16_updates", "average_every": 16},
        "all_ranks, one-peer-exp, bf16 updates, exact average every 16 steps",
    ),
    **{
        f"exp-avg{every}-global": Method(
            {
                "topology": "one-peer-exp",
                "exchange": "bf16_updates",
                "average_every": every,
                "second_moment": "global",
            },
            f"one-peer-exp, bf16 updates, exact average every {every} steps with the ranks' floored "
            "estimates, overlapped",
        )
        for every in (8, 16, 32)
    },
    "exp-avg32-global-sync300": Method(
        {
            "topology": "one-peer-exp",
            "exchange": "bf16_updates",
            "average_every": 32,
            "second_moment": "global",
            "sync_steps": 300,
        },
        "exp-avg32-global with its first 300 steps (the rate's warm-up) mixed before the next gradient, "
        "then overlapped: consensus kept small early, where it costs most",
    ),
    "complete": Method({"topology": "complete"}, "all_ranks on complete (an exact average every step)"),
    **{
        f"sync-{graph}-avg{every}{suffix}": Method(
            {"topology": topology, "exchange": "bf16_updates", "average_every": every, "sync_steps": ALWAYS}
            | ({"second_moment": moment} if moment is not None else {}),
            f"{topology}, bf16 updates, exact average every {every} steps, every step mixed before the "
            f"next gradient; {about}",
        )
        for graph, topology in (("exp", "one-peer-exp"), ("aer", "aer"))
        for every in (4, 8, 16, 32)
        for suffix, moment, about in (
            ("", None, "all_ranks"),
            ("-global", Global(), "the ranks' floored estimates averaged at the exact averages"),
            ("-global-raw", Global(floored=False), "the ranks' raw estimates averaged, the mean floored"),
        )
    },
    "sync-complete-global-raw": Method(
        {
            "topology": "complete",
            "exchange": "bf16_updates",
            "sync_steps": ALWAYS,
            "second_moment": Global(floored=False),
        },
        "complete, bf16 updates, every step mixed before the next gradient, the ranks' raw second-moment "
        "estimates averaged: All-Reduce but for the second moment's estimate and the updates' rounding",
    ),
    "complete-global": Method(
        {"topology": "complete", "second_moment": "global"},
        "complete, the ranks' second moments averaged every step",
    ),
}


class Counter:
    """Prices the exchanges of every simulated rank as inter-node traffic (module docstring)."""

    def __init__(self, nodes: int, ranks_per_node: int) -> None:
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.inter_node_bytes = [0.0] * (nodes * ranks_per_node)
        self.global_steps: set[int] = set()
        self.step = 0

    def wrap(self, rank: int, simulated: Any) -> Any:
        return _Counting(self, rank, simulated)

    def add(self, rank: int, tensor: Tensor, group: Group) -> None:
        spanned = len({member // self.ranks_per_node for member in group})
        if spanned < 2:
            return
        size = tensor.numel() * tensor.element_size()
        per_node = 2 * (spanned - 1) / spanned * size
        self.inter_node_bytes[rank] += per_node / (len(group) / spanned)
        if spanned == self.nodes:
            self.global_steps.add(self.step)


class _Counting:
    def __init__(self, counter: Counter, rank: int, inner: Any) -> None:
        self.counter, self.rank, self.inner = counter, rank, inner
        self.world_size = inner.world_size

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        self.counter.add(self.rank, tensor, group)
        handle: Handle = self.inner.group_sum(tensor, group)
        return handle

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        self.inner.broadcast(tensor, src)

    def world_sum(self, tensor: Tensor) -> None:
        self.inner.world_sum(tensor)


def method_options(name: str, nodes: int, per_node: int) -> dict[str, Any]:
    """The flat options (``decentadam.make_setting``'s keywords, and ``local_world_size``) that
    ``name`` runs with on ``nodes`` nodes of ``per_node`` ranks; {} for All-Reduce."""
    method = METHODS[name]
    if method.options is None:
        return {}
    options = dict(method.options) if name == DEFAULT else GRID_BASE | method.options
    options["local_world_size"] = per_node  # what the launcher's LOCAL_WORLD_SIZE gives it
    if method.accum is not None:
        options["accum_steps"] = method.accum(nodes)
    if name != DEFAULT:  # a node's ranks average their gradients, but where a method says otherwise
        options.setdefault("intra_node", "all_reduce" if per_node > 1 and name != "accumadam" else "gossip")
    return options


def recorded_options(record: dict[str, Any]) -> dict[str, Any]:
    """All the flat options a committed run of this grid ran with: its ``options`` (as
    :func:`method_options` wrote them, a second moment as its repr), on :data:`GRID_BASE` but for
    ``default``, with the layout's ``intra_node`` where the run's options leave it out (the runs made
    before the method names were spelled out on the base record only what they changed)."""
    options = dict(record.get("options") or {})
    if record["method"] == DEFAULT:
        return options
    per_node = int(record.get("ranks_per_node", 1))
    options = GRID_BASE | options
    options.setdefault(
        "intra_node", "all_reduce" if per_node > 1 and record["method"] != "accumadam" else "gossip"
    )
    return options


def code_commit() -> str:
    """The commit of the code that ran (with ``+dirty`` if the work tree had changes)."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.parity.scale run")
    parser.add_argument("--data", required=True)
    parser.add_argument("--preset", default="multi30k-en-de")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--method", choices=sorted(METHODS), required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True, help="folder of the runs' JSON files")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe settings")
    args = parser.parse_args(argv)
    code = code_commit()  # at the start: the tree may be checked out anew during a long run
    import torch

    from benchmarks.parity import workers
    from recipes.translation import config

    method = METHODS[args.method]
    nodes, per_node = args.nodes, args.ranks_per_node
    if per_node == 1 and not method.nodes_of_one:
        parser.error(f"--method {args.method} needs nodes of at least 2 ranks (--ranks-per-node 2)")
    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = nodes * per_node
    optimizer = "allreduce" if method.options is None else "decentralized"
    cfg = config.load(
        args.preset,
        [f"data={args.data}", f"optim.optimizer={optimizer}", f"train.seed={args.seed}", *args.overrides],
    )
    options = method_options(args.method, nodes, per_node)
    counter = Counter(nodes, per_node)

    def on_step(step: int) -> None:
        counter.step = step

    namespace = argparse.Namespace(
        workers=ranks, device=args.device, optimizer_class="decentadam.DecentralizedAdam",
        steps=args.steps, eval_every=args.eval_every, diagnose=False, diagnose_every=50, bleu=False,
    )  # fmt: skip
    result = workers.train(namespace, cfg, options, counter.wrap, on_step)
    parameter_bytes = 4 * result["parameter_count"]  # S: the float32 parameters
    if method.options is None:  # DDP: a ring all-reduce of float32 gradients over the nodes
        inter = 2 * (nodes - 1) / nodes * parameter_bytes / per_node
        global_per_step = 1.0 if nodes > 1 else 0.0
    else:
        inter = sum(counter.inter_node_bytes) / ranks / args.steps
        global_per_step = len(counter.global_steps) / args.steps
    record = {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "tokens_per_rank": cfg.train.global_tokens // ranks,
        "method": args.method,
        "about": method.about,
        "is_default": args.method == DEFAULT,
        "seed": args.seed,
        "lr": cfg.optim.lr,
        "steps": args.steps,
        "parameter_bytes": parameter_bytes,
        "inter_node_bytes_per_step": inter,
        "ddp_bf16_bytes_per_step": 2 * (nodes - 1) / nodes * parameter_bytes / 2 / per_node,
        "global_collectives_per_step": global_per_step,
        "optimizer_bytes_sent_per_step": (
            sum(s["bytes_sent"] for s in result["stats"]) / ranks / args.steps if result["stats"] else None
        ),
        "options": {k: v if isinstance(v, int | float | str) else repr(v) for k, v in options.items()},
        "command": shlex.join([sys.executable, "-m", "benchmarks.parity.scale", "run", *argv]),
        "code": code,
        "curve": [{"step": p["step"], "valid_nll": p["valid_nll"]} for p in result["curve"]],
        "consensus": [{"step": p["step"], "relative": p["consensus_distance_rel"]} for p in result["curve"]],
        "seconds": result["curve"][-1]["seconds"] if result["curve"] else 0.0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.method}-n{nodes}x{per_node}-s{args.seed}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("run", "table"):
        raise SystemExit(__doc__)
    if argv[0] == "run":
        run(argv[1:])
    else:
        from benchmarks.parity.scale_table import main as table

        table(argv[1:])


if __name__ == "__main__":
    main()
