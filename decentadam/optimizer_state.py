"""What :class:`~decentadam.DecentralizedAdam` adds to torch's optimizer state, and how a saved one is read.

``state_dict()`` is AccumAdamW's state of this rank (per parameter: ``step``, ``exp_avg``,
``exp_avg_sq``, and by setting ``grad_accum``, ``noise_sq``, ``group_sq`` / ``group_updates``,
``shared_sq``, ``exchange_ref``) plus one entry ``"decentralized"``: the step counter, the second
moment and the layout of the groups, with these keys::

    step, second_moment, v_every, share_second_moment_every, sync_steps,     # the run
    topology, world_size, local_world_size, intra_node, exchange             # its groups

A state saved with another layout resumes without its reference point ``r``
(:mod:`decentadam.exchanges.parameters`); one saved with another setting resumes with a warning,
keeping the second moment's state where both use it. States saved before the second moment's
source left the param groups carry its keys there (:data:`LEGACY_GROUP_KEYS`); loading drops them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from decentadam.options import Setting
from decentadam.topology import Topology

__all__ = ["LEGACY_GROUP_KEYS", "Loaded", "entry", "read"]

logger = logging.getLogger(__name__)

LEGACY_GROUP_KEYS = ("noise_ranks", "floor_ranks", "v_every")
"""Param-group keys of states saved by earlier versions, dropped on loading."""


def _layout(setting: Setting, topology: Topology, world_size: int) -> dict[str, Any]:
    """What decides the groups a rank exchanges with, and so whom ``exchange="bf16_updates"``'s r is
    shared with."""
    return {
        "topology": topology.name,
        "world_size": world_size,
        "local_world_size": topology.local_world_size,
        "intra_node": setting.intra_node,
        "exchange": setting.exchange,
    }


def entry(step: int, setting: Setting, topology: Topology, world_size: int) -> dict[str, Any]:
    """The ``"decentralized"`` entry of a state dict (module docstring)."""
    return {
        "step": step,
        "second_moment": setting.second_moment.name,
        "v_every": setting.v_every,
        "share_second_moment_every": setting.share_every,
        "sync_steps": setting.sync_steps,
        **_layout(setting, topology, world_size),
    }


@dataclass(frozen=True)
class Loaded:
    """What a loaded state means for the optimizer that loads it."""

    step: int | None  # t to continue from (None: the state has no decentralized entry)
    same_groups: bool  # saved with this layout of groups: its r is alike on them
    sync_steps: int | None  # the warm-up it was saved with (None: no entry)


def read(extra: dict[str, Any] | None, setting: Setting, topology: Topology, world_size: int) -> Loaded:
    """Read a state's ``"decentralized"`` entry (None: a plain AccumAdamW state), warning where it
    was saved with another topology, world size, second moment or exchange."""
    if extra is None:
        return Loaded(None, False, None)
    if extra["world_size"] != world_size or extra["topology"] != topology.name:
        logger.warning(
            "optimizer state was saved with topology %s on %d ranks; continuing with %s on %d",
            *(extra["topology"], extra["world_size"]),
            *(topology.name, world_size),
        )
    saved_moment = (
        extra.get("second_moment"),
        extra.get("v_every"),
        extra.get("intra_node", "gossip"),
        extra.get("share_second_moment_every", 0),
    )
    now = entry(0, setting, topology, world_size)
    now_moment = (now["second_moment"], now["v_every"], now["intra_node"], now["share_second_moment_every"])
    if saved_moment != now_moment:
        logger.warning(
            "optimizer state was saved with second_moment=%r, v_every=%r, intra_node=%r, "
            "share_second_moment_every=%r; continuing with %r, %r, %r, %r (the second moment's "
            "state is kept where both use it)",
            *saved_moment,
            *now_moment,
        )
    if extra.get("exchange", "parameters") != setting.exchange:
        logger.warning(
            "optimizer state was saved with exchange=%r; continuing with %r",
            extra.get("exchange", "parameters"),
            setting.exchange,
        )
    # keys that older states lack count as the defaults they were saved with
    saved = {"local_world_size": None, "intra_node": "gossip", "exchange": "parameters", **extra}
    layout = _layout(setting, topology, world_size)
    same_groups = all(saved.get(key) == value for key, value in layout.items())
    return Loaded(int(extra["step"]), same_groups, int(extra.get("sync_steps", 0)))
