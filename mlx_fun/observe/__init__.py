"""Routing observed: saliency, collection, statistics, evaluation, refusal and residual directions."""
