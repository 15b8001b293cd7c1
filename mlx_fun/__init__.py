"""mlx-fun: compress, analyse and steer Mixture-of-Experts models with MLX."""

__version__ = "0.1.0"
