"""The bottom layer: atomic writes, paths, sizes, JSON input, value ranges, class swaps."""
