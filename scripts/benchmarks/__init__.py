"""Benchmarks and minimal repros: each prints its measurements, most end with ``key=value`` ratios."""
