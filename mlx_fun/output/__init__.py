"""Writing a model directory: streamed weights and the model card."""
