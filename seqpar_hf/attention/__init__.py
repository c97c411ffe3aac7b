"""Attention under sequence parallelism: the local kernels, masks, Ulysses and ring."""
