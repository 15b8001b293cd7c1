"""What the scripts share (imported as ``scripts.lib.<module>``; nothing here is part of the mlx_fun package).

- :mod:`.paths`: the repository root and the bundled models and data;
- :mod:`.options`: argparse option blocks that several scripts take;
- :mod:`.procs`: child processes: the checkout on their ``PYTHONPATH``, busy processes for contention;
- :mod:`.servers`: starting, waiting for and stopping a server on a free loopback port;
- :mod:`.models`: the Qwen3-30B-A3B-shaped benchmark model, random saliency statistics;
- :mod:`.chat`: chat-model prompt sets, greedy replies and refusal rates;
- :mod:`.router_log`: the router tap and load-balancing losses of the training scripts.

Modules import MLX only inside functions (or, :mod:`.router_log`, once the importer has called
``mlx_fun.runtime.blas.maybe_reexec``), so a script can still re-exec with the fast BLAS first.
"""
