"""Call time: what a patched model runs in a forward. The batch compared over the replica and validated,
sharded along the sequence with its positions and per-forward context; the attention sites; labels, the
loss and the tiled LM head; the per-instance state the forwards read. Imports nothing above it in models/."""
