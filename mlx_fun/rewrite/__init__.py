"""Weight surgery: prune (REAP), merge (REAM), abliterate, amplify and quantize, each rewriting a loaded model's
weights in place for :mod:`mlx_fun.output.model_dir` to write."""
