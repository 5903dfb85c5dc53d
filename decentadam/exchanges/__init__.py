"""The exchanges of :class:`~decentadam.DecentralizedAdam`, one module per kind, one interface.

Each kind owns its buffers (per bucket) and the arithmetic it folds into the parameters, their
gradients or the optimizer state; :class:`~decentadam.exchanges.link.Link` is the one path to the
communicator. For every bucket the optimizer's step calls, in this order::

    finish(bucket)            group_gradient.GroupGradients, moments.MomentShares,
                              node_gradients.NodeGradients, parameters.ParameterExchange
    the AccumAdamW update     optim/accum_adamw.py, with the optimizer's MomentSource
    start(bucket, t + 1)      parameters, group_gradient, moments (node_gradients start at the
                              beginning of the step, from this step's gradients)

``settle(bucket, timeout)`` waits for what is in flight outside a step (state_dict, averaging,
close) and folds what belongs to the state; ``abandon()`` forgets sums a dead peer never finished.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from decentadam.buckets import Bucket

__all__ = ["Exchange"]


class Exchange(Protocol):
    """One kind of exchange of the optimizer (module docstring)."""

    def start(self, bucket: Bucket, step: int) -> None:
        """Send this bucket's part for step ``step`` to its group of that step (asynchronous)."""
        ...

    def finish(self, bucket: Bucket) -> None:
        """At the step: wait for what this bucket received, if anything, and fold it in."""
        ...

    def settle(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Outside a step: wait for what is in flight; fold in what belongs to the optimizer state."""
        ...

    def abandon(self) -> None:
        """Forget the exchanges in flight (their peers died); the state keeps what it had."""
        ...
