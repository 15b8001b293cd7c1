"""How the bundled models were made: corpus and safety data, training, fine-tuning, GPU recipes."""
