"""``mlx-fun serve``: mlx-lm's OpenAI-compatible server with exact expert counting and REST steering.

counting (what a forward processed, its routing) · generator (mlx-lm's provider and loop, subclassed) · handler and
routes (HTTP) · app (start / stop) · loadtest (concurrent load with the counts check). The job is
:mod:`mlx_fun.jobs.serve`.
"""
