"""Calibration samples and the corpora they are built from."""
