"""The transformers side: model families, positions, per-forward context, input sharding, the patch, the loss."""
