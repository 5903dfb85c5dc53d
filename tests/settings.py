"""Settings for tests of the optimizer's mechanics (checkpoints, overlap, failures, adapters), which
must not move when the default setting does."""

from __future__ import annotations

from typing import Any

from decentadam import Setting


def plain(topology: str = "aer", **changes: Any) -> Setting:
    """Every rank a worker of ``topology``, float32 parameters, no exact averages, the ``AllRanks``
    second moment (the default setting until 2026-11-29), with ``changes``."""
    options: dict[str, Any] = {
        "exchange": "parameters",
        "average_every": 0,
        "intra_node": "gossip",
        "second_moment": "all_ranks",
    }
    return Setting(topology=topology, **(options | changes))
