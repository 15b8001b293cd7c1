"""The process around the model: lean imports, a fast BLAS, its thread governor."""
