"""The project's scripts: benchmarks, training recipes and tools, beside the shared helpers they import.

Run them as modules from the repository root, e.g. ``python -m scripts.tools.prepare_dataset --help``: ``-m`` puts
the current directory first on ``sys.path``, so ``scripts.lib`` and the checkout's ``mlx_fun`` import without any
``sys.path`` edit. See scripts/README.md.
"""
