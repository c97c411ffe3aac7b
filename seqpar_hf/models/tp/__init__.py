"""Megatron-style tensor + sequence parallelism on DTensor: the plan applied, what it leaves out checked
or refused, block inputs gathered again in the backward. Reads only `models.families`."""
