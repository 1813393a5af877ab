"""Strata: serve large Mixture-of-Experts GGUF models on one small GPU."""

__version__ = "0.1.0"
