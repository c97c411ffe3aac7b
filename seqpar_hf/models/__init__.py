"""The transformers side: model families, positions, per-forward context, input sharding, the patch, the loss,
generation under SP (the generate wrapper, decoding steps, the sequence-sharded KV cache)."""
