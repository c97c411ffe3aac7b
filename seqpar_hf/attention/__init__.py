"""Attention under sequence parallelism: the local kernels, masks, Ulysses and ring; decoding steps over
sharded keys."""
