"""Asynchronous decentralized training: A2CiD2, the pairing of its averagings, and their graphs.

:mod:`~decentadam.asynchronous.a2cid2` (the optimizer), :mod:`~decentadam.asynchronous.continuized`
(its momentum's constants and updates), :mod:`~decentadam.asynchronous.pairing` (who averages with
whom, and when) and :mod:`~decentadam.asynchronous.graph` (which pairs may average).
Nothing here imports the synchronous optimizer (:mod:`decentadam.decentralized`).
"""

from decentadam.asynchronous.a2cid2 import A2CiD2, continuized_constants
from decentadam.asynchronous.graph import Graph, as_graph, build_graph
from decentadam.asynchronous.pairing import PeerFailure

__all__ = ["A2CiD2", "Graph", "PeerFailure", "as_graph", "build_graph", "continuized_constants"]
