"""``mlx-fun ui``: the Gradio dashboard for a running ``mlx-fun serve``, one module per tab (:mod:`.tabs`).

It talks to the server only over HTTP (:mod:`.client`); figures are pure functions of arrays (:mod:`.plots`); the
Merge and Diff tabs call the CLI's own functions on saliency files in the UI's ``--data-dir`` (:mod:`.analysis`).
Gradio and matplotlib come with the ``ui`` extra: ``pip install 'mlx-fun[ui]'``. Nothing here imports gradio
until the page is built.
"""
