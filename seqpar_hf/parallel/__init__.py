"""Ranks, groups and collectives: the layout (a named DeviceMesh), collectives as autograd functions, shard plans."""
