"""Expert selections, expert lists on disk, steering reports."""
