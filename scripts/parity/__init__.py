"""Parity scripts: the papers' own reference code (a PyTorch venv, the reference tree given as ``--reference``)
against mlx-fun on the same model and tokens, number against number (issue 45; docs/benchmarks/parity.md)."""
