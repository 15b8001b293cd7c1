"""Parity scripts: the papers' own code on the same model as mlx-fun, number against number (issue 45)."""
