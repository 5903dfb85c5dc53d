"""Moved to :mod:`decentadam.asynchronous.a2cid2`; this module keeps the old import path working."""

from decentadam.asynchronous.a2cid2 import (
    A2CiD2,
    ContinuizedConstants,
    continuized_average_,
    continuized_constants,
    continuized_mix_,
    gossip_store,
)

__all__ = [
    "A2CiD2",
    "ContinuizedConstants",
    "continuized_average_",
    "continuized_constants",
    "continuized_mix_",
    "gossip_store",
]
