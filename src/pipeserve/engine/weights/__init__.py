"""Model weights: resolving sources to folders, loading with mlx-lm, dtypes, GGUF conversion, offline demo models, memory release."""
