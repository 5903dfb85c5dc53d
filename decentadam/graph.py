"""Moved to :mod:`decentadam.asynchronous.graph`; this module keeps the old import path working."""

from decentadam.asynchronous.graph import GRAPHS, Edge, Graph, as_graph, build_graph

__all__ = ["GRAPHS", "Edge", "Graph", "as_graph", "build_graph"]
