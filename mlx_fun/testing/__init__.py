"""Tiny models of every family and the server load test, for tests and benchmarks."""
