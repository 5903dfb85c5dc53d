"""The parity study: decentralized Adam against All-Reduce step for step at small local batches.

``oracle`` checks that the two recipe paths agree when the decentralized optimizer is fed the
all-reduced gradient (``mean_gradients`` is the per-rank entry point that does it).
"""
