"""Transformer translation with All-Reduce or decentralized AccumAdam (README.md in this folder)."""
