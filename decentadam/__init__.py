"""decentadam: decentralized data-parallel Adam for PyTorch.

Each rank keeps its own copy of the model, takes a local AccumAdamW step and averages its
parameters with one or a few neighbours on a changing graph, while that exchange overlaps the next
forward/backward.
"""

from decentadam.decentralized import CommStats, DecentralizedAdam
from decentadam.optim.accum_adamw import AccumAdamW, accum_adamw
from decentadam.topology import Topology, build

__all__ = ["AccumAdamW", "CommStats", "DecentralizedAdam", "Topology", "accum_adamw", "build"]
__version__ = "0.1.0"
