"""Benchmarks: scripts that measure and write reports (benchmarks/results/); docs/benchmarks.md."""
