"""Predict the per-iteration time of All-Reduce and of each gossip topology on a given cluster.

:mod:`decentadam.runtime_model.model` states the model and computes it;
:mod:`decentadam.runtime_model.cli` is its command line::

    python -m decentadam.runtime_model --params 350M --compute-ms 180 --nodes 8 --gpus-per-node 4 \\
        --inter-gbps 25
"""

from decentadam.runtime_model.cli import build_parser, main, parse_size, recommend
from decentadam.runtime_model.model import *  # noqa: F403
from decentadam.runtime_model.model import __all__ as _model_names

__all__ = [*_model_names, "build_parser", "main", "parse_size", "recommend"]
