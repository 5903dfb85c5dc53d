"""The continuized momentum of A2CiD2 as plain functions: its constants and its two updates.

The algorithm and the notation are in :mod:`decentadam.asynchronous.a2cid2`; these functions hold
its arithmetic, with no threads or communication, so they are tested on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from decentadam.asynchronous.graph import Graph

__all__ = ["ContinuizedConstants", "continuized_average_", "continuized_constants", "continuized_mix_"]


@dataclass(frozen=True)
class ContinuizedConstants:
    """The A2CiD2 constants of a graph at a communication rate (see the module docstring)."""

    rate: float
    chi1: float
    chi2: float
    eta: float
    alpha_tilde: float


def continuized_constants(graph: Graph, rate: float) -> ContinuizedConstants:
    """chi1, chi2, eta and alpha~ of ``graph`` when each rank averages ``rate`` times per unit of time.

    A single rank has nothing to average: every constant is 0. Raises ValueError for a
    disconnected graph (some ranks would never meet) or a rate that is not positive.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 averagings per gradient step, got {rate}")
    if graph.world_size == 1:
        return ContinuizedConstants(rate, 0.0, 0.0, 0.0, 0.0)
    if not graph.is_connected():
        raise ValueError(f"graph {graph.name!r} is not connected: some ranks would never average together")
    laplacian = graph.laplacian(rate)
    eigenvalues = torch.linalg.eigvalsh(laplacian)
    positive = eigenvalues[eigenvalues > 1e-9 * float(eigenvalues.max())]
    chi1 = 1.0 / float(positive.min())
    pinv = torch.linalg.pinv(laplacian, hermitian=True)
    chi2 = max(0.5 * float(pinv[i, i] + pinv[j, j] - 2 * pinv[i, j]) for i, j in graph.edges)
    eta = 1.0 / (2.0 * math.sqrt(chi1 * chi2))
    alpha_tilde = 0.5 * math.sqrt(chi1 / chi2)
    return ContinuizedConstants(rate, chi1, chi2, eta, alpha_tilde)


def continuized_mix_(params: list[Tensor], offsets: list[Tensor], eta: float, dt: float) -> None:
    """Mix ``x`` (``params``) and ``x~ = x + y`` (``offsets`` hold ``y``) for ``dt``, in place.

    ``a = exp(-2 eta dt)``: ``x += (1 - a) / 2 * y``, ``y *= a``; that is ``x + x~`` unchanged and
    ``x - x~`` times ``a``, the closed form of the ODE.
    """
    if not offsets or eta == 0.0 or dt <= 0.0:
        return
    a = math.exp(-2.0 * eta * dt)
    torch._foreach_add_(params, offsets, alpha=(1.0 - a) / 2.0)
    torch._foreach_mul_(offsets, a)


def continuized_average_(
    params: list[Tensor], offsets: list[Tensor], deltas: list[Tensor], alpha_tilde: float
) -> None:
    """Averaging with ``deltas = d = x_j - x_i``: ``x += d / 2``, ``x~ += alpha~ d`` (``y`` += the rest)."""
    torch._foreach_add_(params, deltas, alpha=0.5)
    if offsets:
        torch._foreach_add_(offsets, deltas, alpha=alpha_tilde - 0.5)
