"""What the benchmarks' reports judge by, in one place: the goals they mark met or missed and the
conditions their generated notes check before they state a conclusion."""

from __future__ import annotations

MODEL_TOLERANCE = 0.15
"""The runtime model counts as right when its prediction is within 15% of the measurement."""

# ------------------------------------------------------------------------- the cluster benchmark

CLUSTER_AER_RATIO = 0.5
"""AER's iteration should take at most half of All-Reduce's."""
CLUSTER_BOUND_RATIO = 1.10
"""... and at most 10% more than the model's lower bound max(C, comm)."""

# ------------------------------------------------------------------------- time to quality

TTQ_TIME_RATIO = 0.6
"""AER should reach All-Reduce's final validation loss in at most this share of All-Reduce's time
(issue 21; 0.7 before it)."""
TTQ_BLEU_GAP = 0.5
"""... and, trained for no longer than All-Reduce, end within this many BLEU points of it."""
MODEL_MISSED = 0.10
"""A prediction more than 10% below the measured iteration counts as a term the model misses."""
WAIT_SHARE = 0.10
"""Ranks that block for more than this share of C per step wait for their exchanges noticeably."""
GOSSIP_SHARE = 0.25
"""AER's distance to All-Reduce is called (partly) the gossip's when AER's excess over AccumAdam on
the complete graph (exact averaging, the same local steps), summed over the common evaluations where
AER is behind All-Reduce, is more than this share of its distance to All-Reduce summed over them;
at or below it, the distance is in what both AccumAdam runs do differently from All-Reduce."""
