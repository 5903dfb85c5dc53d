"""How the gap to All-Reduce grows with the number of workers at a fixed global batch: the table.

Runs :mod:`benchmarks.parity.workers` for each worker count and method (All-Reduce;
``DecentralizedAdam`` with each rank's own second moment, ``second_moment=local``; with the
default ``second_moment=all_ranks``; and with the gradients averaged inside nodes of
``optim.local_world_size`` ranks, ``intra_node=all_reduce`` with ``second_moment=group_gradient``,
which on one node is All-Reduce; the same with the nodes' second moment shared every 2 steps,
``share_second_moment_every=2``), one process each, and writes ``OUT/workers.md`` and
``OUT/workers.json``: the validation NLL of each run at every evaluation, and its difference to
All-Reduce's at the same worker count. A run whose JSON is already in ``OUT`` is not repeated, so
an interrupted table resumes::

    python -m benchmarks.parity.workers_table --preset multi30k-en-de --data MULTI30K \\
        --workers 2 4 8 16 --steps 400 --out runs/workers

Extra ``key=value`` arguments go to every run (e.g. ``optim.topology=complete``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.parity import workers


class Method(NamedTuple):
    """One row kind of the table: the optimizer, its overrides, and the stem of its runs' files."""

    optimizer: str
    overrides: list[str]
    stem: str


METHODS: dict[str, Method] = {
    "All-Reduce": Method("allreduce", [], "allreduce"),
    "own v (local)": Method("decentralized", ["optim.second_moment=local"], "decentralized-local"),
    "all_ranks (default)": Method(
        "decentralized", ["optim.second_moment=all_ranks"], "decentralized-all_ranks"
    ),
    "nodes (intra_node=all_reduce)": Method(
        "decentralized",
        ["optim.intra_node=all_reduce", "optim.second_moment=group_gradient"],
        "decentralized-all_reduce",
    ),
    "nodes, second moment shared every 2 steps": Method(
        "decentralized",
        [
            "optim.intra_node=all_reduce",
            "optim.second_moment=group_gradient",
            "optim.share_second_moment_every=2",
        ],
        "decentralized-all_reduce-shared2",
    ),
}


def run_name(method: str, n: int) -> str:
    return f"{METHODS[method].stem}-n{n}.json"


def nll_cell(value: float, reference: float | None) -> str:
    """``value`` to 3 decimals, and its difference to ``reference`` in brackets where there is one."""
    return f"{value:.3f}" + (f" ({value - reference:+.3f})" if reference is not None else "")


def render(results: dict[str, dict[int, dict[str, Any]]], command: str) -> str:
    """Markdown: one row per worker count and method, valid NLL (difference to All-Reduce's)."""
    any_run = next(run for by_n in results.values() for run in by_n.values())
    steps = [p["step"] for p in any_run["curve"]]
    lines = [
        "# Validation NLL against the number of workers at a fixed global batch",
        "",
        f"Command: `{command}`",
        "",
        "Each cell: the exact average's validation NLL at that step (its difference to All-Reduce's "
        "with the same workers). Simulated ranks in one process (`benchmarks.parity.workers`).",
        "",
        "| workers | tokens per worker | method | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---:|---:|---|" + "---:|" * len(steps),
    ]
    counts = sorted({n for by_n in results.values() for n in by_n})
    for n in counts:
        reference = results.get("All-Reduce", {}).get(n)
        ref_nll = {p["step"]: p["valid_nll"] for p in reference["curve"]} if reference else {}
        for method in METHODS:
            run = results.get(method, {}).get(n)
            if run is None:
                continue
            cells = []
            for point in run["curve"]:
                reference_nll = ref_nll.get(point["step"]) if method != "All-Reduce" else None
                cells.append(nll_cell(point["valid_nll"], reference_nll))
            lines.append(f"| {n} | {run['tokens_per_worker']} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--workers", type=int, nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.workers):
        parser.error(f"--workers must be >= 1, got {args.workers}")
    command = shlex.join([sys.executable, "-m", "benchmarks.parity.workers_table", *(argv or sys.argv[1:])])
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for n in args.workers:
        for method in args.methods:
            optimizer, overrides, _ = METHODS[method]
            out = args.out / run_name(method, n)
            if not out.exists():
                print(f"== {method}, {n} workers -> {out}", flush=True)
                workers.main(
                    [
                        "--preset", args.preset, "--data", args.data, "--workers", str(n),
                        "--optimizer", optimizer, "--steps", str(args.steps),
                        "--eval-every", str(args.eval_every), "--out", str(out),
                        *args.overrides, *overrides,
                    ]
                )  # fmt: skip
            results.setdefault(method, {})[n] = json.loads(out.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workers.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    table = render(results, command)
    (args.out / "workers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
