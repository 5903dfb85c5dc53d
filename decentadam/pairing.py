"""Moved to :mod:`decentadam.asynchronous.pairing`; this module keeps the old import path working."""

from decentadam.asynchronous.pairing import (
    HEARTBEAT_SECONDS,
    Clock,
    MatchClient,
    Matchmaker,
    PairingWorker,
    PeerFailure,
    Schedule,
)

__all__ = [
    "HEARTBEAT_SECONDS",
    "Clock",
    "MatchClient",
    "Matchmaker",
    "PairingWorker",
    "PeerFailure",
    "Schedule",
]
