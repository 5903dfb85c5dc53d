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

TTQ_DEFAULT_RATIO = 0.5
"""The library's default should reach float32 DDP's final validation loss in at most this share of
DDP's training time, on the mean of the seeds (and sooner than each alternative a user has)."""
TTQ_BLEU_GAP = 0.5
"""... and, trained for no longer than DDP, end within this many BLEU points of it."""
