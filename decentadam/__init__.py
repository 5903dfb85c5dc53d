"""decentadam: decentralized data-parallel Adam for PyTorch.

Each rank keeps its own copy of the model, takes a local AccumAdamW step and averages its
parameters with one or a few neighbours on a changing graph, while that exchange overlaps the next
forward/backward. What it sends and which second moment it divides by is a :class:`Setting`, one
of :data:`SETTINGS` by name (docs/choosing.md); how the ranks talk is a :class:`Comm`.
:class:`A2CiD2` is the asynchronous alternative: pairwise averagings with graph neighbours at
random times, beside gradient steps that never wait for another rank.
"""

from decentadam.asynchronous.a2cid2 import A2CiD2
from decentadam.asynchronous.graph import Graph
from decentadam.decentralized import CommStats, DecentralizedAdam
from decentadam.optim.accum_adamw import AccumAdamW, accum_adamw
from decentadam.options import (
    SETTINGS,
    AllRanks,
    Comm,
    Global,
    GroupGradient,
    Local,
    Setting,
    make_setting,
)
from decentadam.topology import Topology, build

__all__ = [
    "SETTINGS",
    "A2CiD2",
    "AccumAdamW",
    "AllRanks",
    "Comm",
    "CommStats",
    "DecentralizedAdam",
    "Global",
    "Graph",
    "GroupGradient",
    "Local",
    "Setting",
    "Topology",
    "accum_adamw",
    "build",
    "make_setting",
]
__version__ = "0.1.0"
