r"""Probe: a rank's own update reaches its parameters only through the exchange.

``DecentralizedAdam`` overlaps the exchange by mixing the neighbours' parameters of the previous
step and then applying the rank's own update at once (``x(t+1) = W x(t) - lr u(t)``): every
gradient is taken at a point that holds the rank's own latest, noisy step, which no neighbour has
seen. On 16 single-rank nodes that costs ~0.5 nats at step 400 against the same setting waiting
for its exchange (``sync_steps``: ``x(t+1) = W (x(t) - lr u(t))``, no overlap; study 18).

Here the rank sends the point its update leads to, ``y = x - lr u``, but keeps training on ``x``
until the exchange returns ``W y``::

    x(t+1) = W (x(t) - lr u(g(x(t-1))))

the synchronous mixing, with every exchange still in flight during the next forward/backward and
each gradient one step old. On the complete graph every rank holds the same ``x`` and this is
All-Reduce's Adam one step late. Bytes and collectives are those of the wrapped setting.

:class:`PredictedHeldAdam` also takes each gradient at a predicted point: the held ``x(t)`` moved on
by its last mixed displacement, ``z(t) = x(t) + (x(t) - x(t-1))`` (weight prediction, as pipelined
training uses against stale gradients). The displacement came through the mixing, so on the complete
graph it is ``-lr`` times the mean of the updates the last exchange carried, alike on every rank.

Memory: two more copies of the parameters (the point sent, and ``x`` while the update is formed;
three with the prediction).
Refuses ``Comm(overlap="backward")`` and ``sync_steps`` (the probe replaces the step's order), and
checkpoints (its held point is not in the state)::

    python -m benchmarks.parity.scale run --data MULTI30K --nodes 16 --method held-exp-avg32-global \
        --seed 1 --steps 400 --out runs optim.lr=1e-3
"""

from __future__ import annotations

from typing import Any

import torch

from decentadam import DecentralizedAdam
from decentadam.buckets import Bucket


class HeldUpdateAdam(DecentralizedAdam):
    """DecentralizedAdam whose own update is applied only through the mixing (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._backward is not None or self.setting.sync_steps:
            raise ValueError("HeldUpdateAdam replaces the step's order: use overlap='step' and sync_steps=0")
        with torch.no_grad():  # after the broadcast: every rank's point is rank 0's
            self._sent = {id(b): [p.detach().clone() for p in b.params] for b in self._buckets}
            self._here = {id(b): [p.detach().clone() for p in b.params] for b in self._buckets}

    def _step_bucket(self, bucket: Bucket) -> None:
        sent, here = self._sent[id(bucket)], self._here[id(bucket)]
        torch._foreach_copy_(bucket.params, sent)  # the point whose exchange arrives: y(t)
        for exchange in self._arriving:
            exchange.finish(bucket)  # x(t+1) = W y(t)
        torch._foreach_copy_(here, bucket.params)
        group = self.param_groups[bucket.group_index]
        self._local_update(self.state, group, [p for p in bucket.params if p.grad is not None], self._source)
        for exchange in self._departing:
            exchange.start(bucket, self._step + 1)  # sends y(t+1) = x(t+1) - lr u
        torch._foreach_copy_(sent, bucket.params)
        torch._foreach_copy_(bucket.params, here)  # the next gradient at x(t+1)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("HeldUpdateAdam is a probe: its held point is not saved")


class PredictedHeldAdam(HeldUpdateAdam):
    """HeldUpdateAdam whose gradients are taken at ``x(t) + (x(t) - x(t-1))`` (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            self._moved = {id(b): [torch.zeros_like(p) for p in b.params] for b in self._buckets}

    def _step_bucket(self, bucket: Bucket) -> None:
        sent, here, moved = self._sent[id(bucket)], self._here[id(bucket)], self._moved[id(bucket)]
        torch._foreach_copy_(bucket.params, sent)
        for exchange in self._arriving:
            exchange.finish(bucket)  # x(t+1) = W y(t)
        torch._foreach_sub_(here, bucket.params)  # x(t) - x(t+1)
        torch._foreach_copy_(moved, here)
        torch._foreach_copy_(here, bucket.params)
        group = self.param_groups[bucket.group_index]
        self._local_update(self.state, group, [p for p in bucket.params if p.grad is not None], self._source)
        for exchange in self._departing:
            exchange.start(bucket, self._step + 1)
        torch._foreach_copy_(sent, bucket.params)
        torch._foreach_sub_(moved, here)  # -x(t+1) - (x(t+1) - x(t)): the predicted point, negated
        torch._foreach_neg_(moved)
        torch._foreach_copy_(bucket.params, moved)  # the next gradient at z(t+1)
