"""Benchmarks users can trust: repeated seeded runs, statistics, comparisons, ablations, FLOPs."""
