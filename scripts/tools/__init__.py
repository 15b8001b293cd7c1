"""User-facing utilities: datasets, tiny models, sharded copies of a model."""
