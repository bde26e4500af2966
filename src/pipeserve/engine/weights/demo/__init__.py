"""Offline demo models: tiny random-weight mlx-lm models with real tokenizers, built on first use."""
