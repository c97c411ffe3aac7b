"""`generate` under SP: the wrapper and its refusals, the one check across the group before it, the
decoding steps' attention over the sharded side, the sequence-sharded KV cache. Built on forward/."""
