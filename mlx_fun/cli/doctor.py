"""doctor (placeholder: being written)."""
COMMANDS: list = []
