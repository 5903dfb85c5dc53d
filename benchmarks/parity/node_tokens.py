"""How often a step's token types are seen by one node only: where sharing the second moment acts.

With ``intra_node="all_reduce"`` each node's second moment ``A`` comes from its own ranks' batches.
A token type that only one node's batch holds in a step gives its input-embedding row a gradient
on that node alone (an output projection gives every row some gradient on every node); that
node's ``A`` then holds the whole square where All-Reduce's would hold it divided among the
nodes, and sharing ``A`` (``share_second_moment_every``) is what removes that difference.
This counts, over the first ``--steps`` steps of the recipe's data order (no training), for source
and target tokens: the share of the step's types held by one node only, the share of the step's
token occurrences whose type is one node's only, and the types per step::

    python -m benchmarks.parity.node_tokens --data MULTI30K --presets multi30k-en-de multi30k-en-fr \\
        --seeds 1 2 3 --steps 400 --out runs/node_tokens.json

The batches are the recipe's (:class:`recipes.translation.data.TokenBatches` for ``--workers``
ranks, ``--ranks-per-node`` per node in rank order, as the recipe's nodes of 2 on one machine);
one epoch at most.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from recipes.translation import config, data


def node_token_stats(
    encoded: data.Encoded, batches: list[list[np.ndarray]], ranks_per_node: int, steps: int
) -> dict[str, dict[str, float]]:
    """``batches[rank][step]``: example indices. Per side (``src``, ``tgt``), the means over the
    steps of: ``types_one_node`` (types held by exactly one node / the step's types),
    ``occurrences_one_node`` (occurrences of such types / the step's tokens), ``types``, ``tokens``."""
    nodes = len(batches) // ranks_per_node
    if nodes < 2 or nodes * ranks_per_node != len(batches):
        raise ValueError(f"{len(batches)} ranks in nodes of {ranks_per_node}: need at least 2 whole nodes")
    steps = min(steps, min(len(b) for b in batches))
    if steps < 1:
        raise ValueError("no step to count: the epoch has no batches for every rank")
    rows: dict[str, list[tuple[float, float, int, int]]] = {"src": [], "tgt": []}
    for step in range(steps):
        for side, which in (("src", 0), ("tgt", 1)):
            per_node = []
            for node in range(nodes):
                ranks = range(node * ranks_per_node, (node + 1) * ranks_per_node)
                per_node.append(
                    np.concatenate([encoded.pair(int(i))[which] for r in ranks for i in batches[r][step]])
                )
            # each node's types once: a type's count is then the number of nodes that hold it
            held = np.concatenate([np.unique(ids) for ids in per_node])
            types, holders = np.unique(held, return_counts=True)
            alone = types[holders == 1]
            every = np.concatenate(per_node)
            rows[side].append(
                (len(alone) / len(types), float(np.isin(every, alone).mean()), len(types), len(every))
            )
    keys = ("types_one_node", "occurrences_one_node", "types", "tokens")
    return {
        side: {key: float(np.mean([row[k] for row in values])) for k, key in enumerate(keys)}
        | {"steps": steps}
        for side, values in rows.items()
    }


def measure(cfg: config.Config, workers: int, ranks_per_node: int, steps: int) -> dict[str, dict[str, float]]:
    """The counts for the recipe's data and batches of ``cfg`` (its seed) on ``workers`` ranks in
    nodes of ``ranks_per_node``."""
    _, _, train_set, _ = data.prepare_data(cfg.data)
    t = cfg.train
    order = data.TokenBatches(
        train_set.src_lengths,
        train_set.tgt_lengths,
        t.global_tokens // (workers * t.grad_accum),
        seed=t.seed,
        world_size=workers,
        multiple_of=t.grad_accum,
    ).all_batches(0)
    # a step is grad_accum micro-batches per rank: their union is what the rank's gradient saw
    per_rank = []
    for rank in range(workers):
        mine = order[rank::workers]
        per_rank.append(
            [np.concatenate(mine[s : s + t.grad_accum]) for s in range(0, len(mine), t.grad_accum)]
        )
    return node_token_stats(train_set, per_rank, ranks_per_node, steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True)
    parser.add_argument("--presets", nargs="+", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for preset in args.presets:
        for seed in args.seeds:
            cfg = config.load(preset, [f"data={args.data}", f"train.seed={seed}", *args.overrides])
            counts = measure(cfg, args.workers, args.ranks_per_node, args.steps)
            results.setdefault(preset, {})[str(seed)] = counts
            for side, c in counts.items():
                print(
                    f"{preset} seed {seed} {side}: {c['types_one_node']:.3f} of the types and "
                    f"{c['occurrences_one_node']:.3f} of the tokens on one node only; "
                    f"{c['types']:.0f} types, {c['tokens']:.0f} tokens per step",
                    flush=True,
                )
    command = shlex.join([sys.executable, "-m", "benchmarks.parity.node_tokens", *(argv or sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
