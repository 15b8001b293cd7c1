"""Weight surgery: prune (REAP); merge, abliterate, amplify and quantize come later."""
