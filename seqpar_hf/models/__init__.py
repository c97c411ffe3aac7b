"""The transformers side, in layers whose imports run one way (down):

- `patch` (the public API) and `registry` (what transformers calls);
- `proof/` (patch time: read the model, prove it by a dry run, or refuse) and `generation/` (generate under SP);
- `forward/` (call time: shard the batch, the per-forward context, the attention sites, the loss);
- `tp/` (Megatron TP+SP on DTensor);
- `families` (the structure a proof finds and every other part reads).
"""
