"""stats-diff, stats-merge, stats-purge (placeholder: being written)."""
COMMANDS: list = []
