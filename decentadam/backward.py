"""``overlap="backward"``: step each bucket from gradient hooks as soon as its gradients are final.

The first iteration only counts how often each parameter's gradient accumulates (tied weights
accumulate twice); ``step()`` updates every bucket. From the second iteration on, a bucket whose
count is reached is ready, and ready buckets are stepped in the fixed bucket order, as DDP launches
its buckets, so that the ranks of a group start their sums in the same order even when a rank skips
a parameter in some iteration: a ready bucket waits for the buckets before it. Whatever is not
stepped when backward ends (a parameter unused in this iteration, or in the first one) is left to
``step()``, which asks :meth:`BackwardSchedule.pending`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from decentadam.buckets import Bucket

__all__ = ["BackwardSchedule"]

UNCOUNTED = -1  # a bucket with a parameter that got no gradient in the counting iteration


class BackwardSchedule:
    """Hook bookkeeping of one optimizer: counts, readiness, order, and the resets between iterations."""

    def __init__(self, buckets: list[Bucket], step_bucket: Callable[[Bucket], None]) -> None:
        self._buckets = buckets
        self._step_bucket = step_bucket
        self._position = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self._counted = False  # the accumulations per parameter are known
        self._counts: dict[int, int] = {}  # accumulations per parameter id in this iteration
        self._expected_counts: dict[int, int] = {}  # the same, counted in the first iteration
        self._expected = [UNCOUNTED] * len(buckets)  # accumulations per bucket and iteration
        self._left = [UNCOUNTED] * len(buckets)  # accumulations still expected in this iteration
        self._next = 0  # the buckets before this one were stepped by the hooks in this iteration
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)  # type: ignore[no-untyped-call]
            for bucket in buckets
            for p in bucket.params
        ]

    @property
    def in_backward(self) -> bool:
        """Some buckets of this iteration were updated already (between backward() and step())."""
        return self._next > 0

    def pending(self) -> list[Bucket]:
        """The buckets the hooks have not stepped in this iteration, in order: ``step()`` steps them."""
        return self._buckets[self._next :]

    def end_iteration(self) -> None:
        """After ``step()``: learn the counts in the first iteration, then expect them again."""
        if not self._counted:
            self._expected_counts = dict(self._counts)
            for i, bucket in enumerate(self._buckets):
                counts = [self._expected_counts.get(id(p), 0) for p in bucket.params]
                self._expected[i] = sum(counts) if min(counts) > 0 else UNCOUNTED
            self._counted = True
        self._counts.clear()
        self._next = 0
        self._left = list(self._expected)

    def recount(self) -> None:
        """Run the next iteration from ``step()`` and count the hooks again (after a state load)."""
        self._counted = False
        self._expected = [UNCOUNTED] * len(self._buckets)
        self._left = list(self._expected)

    def remove(self) -> None:
        """Detach the hooks; raises between backward() and step(), when some buckets were updated."""
        if self.in_backward:
            raise RuntimeError(
                "DecentralizedAdam.remove_hooks() was called between backward() and step(), after the "
                "hooks had updated some buckets of this iteration; call it after step()"
            )
        self.detach()

    def detach(self) -> None:
        """Detach the hooks now (closing the optimizer)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_grad_ready(self, param: Tensor) -> None:
        key = id(param)
        position = self._position[key]
        if position < self._next:
            raise RuntimeError(
                "Comm(overlap='backward'): a gradient arrived for a bucket that was already "
                "updated in this iteration. This happens with gradient accumulation over several "
                "backward passes per optimizer step; use overlap='step' for that."
            )
        count = self._counts[key] = self._counts.get(key, 0) + 1
        if self._left[position] > 0 and count <= self._expected_counts.get(key, 0):
            self._left[position] -= 1
            if self._left[position] == 0:
                self._step_ready()

    def _step_ready(self) -> None:
        """Step the ready buckets that follow the last one stepped, in bucket order (as on every rank)."""
        with torch.no_grad():
            while self._next < len(self._buckets) and self._left[self._next] == 0:
                bucket = self._buckets[self._next]
                self._next += 1
                self._step_bucket(bucket)
