"""Memory beyond the device's: the checkpointed layer inputs offloaded to host memory (`offload`) and the MLP
computed over sequence tiles (`tiled_mlp`). Torch only; `models/patch.py` installs them on a patched model."""
