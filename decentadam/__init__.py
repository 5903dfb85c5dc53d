"""decentadam: decentralized data-parallel Adam for PyTorch.

Each rank keeps its own copy of the model, takes a local AccumAdamW step and averages its
parameters with one or a few neighbours on a changing graph, while that exchange overlaps the next
forward/backward. :class:`A2CiD2` is the asynchronous alternative: pairwise averagings with graph
neighbours at random times, beside gradient steps that never wait for another rank.
"""

from decentadam.asynchronous.a2cid2 import A2CiD2
from decentadam.asynchronous.graph import Graph
from decentadam.decentralized import CommStats, DecentralizedAdam
from decentadam.optim.accum_adamw import AccumAdamW, accum_adamw
from decentadam.topology import Topology, build

__all__ = [
    "A2CiD2",
    "AccumAdamW",
    "CommStats",
    "DecentralizedAdam",
    "Graph",
    "Topology",
    "accum_adamw",
    "build",
]
__version__ = "0.1.0"
