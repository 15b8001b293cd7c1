"""How the experts' grouped matmul runs, chosen per call from measured cut-offs."""
