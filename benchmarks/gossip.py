"""Plain gossip: every rank a worker of the graph, float32 parameters, no exact averages, the
``AllRanks`` second moment. It was DecentralizedAdam's default until 2026-11-29; the benchmarks and
tests of the optimizer's mechanics (the emulated cluster, the soak, the copy and straggler probes,
checkpoints, overlap, failures) and the parity grid's methods are measured on it, so it is written
out here, once, and their numbers do not move with the default."""

from __future__ import annotations

from typing import Any

from decentadam.options import Setting, make_setting

__all__ = ["PLAIN", "plain"]

PLAIN: dict[str, Any] = {
    "exchange": "parameters",
    "average_every": 0,
    "intra_node": "gossip",
    "second_moment": "all_ranks",
}
"""The options plain gossip sets, by ``make_setting``'s names (all but the topology)."""


def plain(topology: str = "aer", **changes: Any) -> Setting:
    """Plain gossip on ``topology``, with ``changes`` (``make_setting``'s names and values)."""
    return make_setting(topology=topology, **(PLAIN | changes))
