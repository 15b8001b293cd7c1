"""Loading a model, its hooked MoE call, the forward engine, generation options."""
