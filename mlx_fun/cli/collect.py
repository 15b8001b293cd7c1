"""collect (placeholder: being written)."""
COMMANDS: list = []
