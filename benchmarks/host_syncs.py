"""Host syncs per training forward + backward: how often the patched model waits for a tensor's value.

    python -m benchmarks.host_syncs                 # 2 and 4 gloo processes, the current tree
    python -m benchmarks.host_syncs --world 2       # one world size

A host sync is any op that reads a tensor's value on the host (`.item()`, `bool(t)`, `.tolist()`,
data-dependent shapes such as `nonzero`); on CUDA each one stalls the launch queue. They are counted
exactly with a `TorchDispatchMode` (`aten._local_scalar_dense`, `aten.nonzero`, ...), on rank 0,
around one forward and backward of an 8-layer Llama-like model with a padded batch, for each mode.
Only the public API is used, so the same script measures an older checkout (`--src PATH`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave")


def count(world: int, mode: str, ring_size, layers: int, src: str | None) -> dict:
    if src:  # --src: that checkout's seqpar_hf, not this one's (measuring another tree is the point)
        sys.path.insert(0, src)
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import seqpar_hf

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in SYNC_OPS:
                self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    layout = seqpar_hf.ParallelLayout(sp_size=world, mode=mode, ring_size=ring_size)
    seqpar_hf.patch_model(model, layout)
    ids = torch.randint(3, 128, (2, 256), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0  # a padded row: the masked paths run
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    model(**batch).loss.backward()  # warm-up (first-call caches)
    with Counter() as forward:
        loss = model(**batch).loss
    with Counter() as backward:
        loss.backward()
    dist.barrier()
    return {
        "mode": mode if ring_size is None else f"{mode}(ring {ring_size})",
        "world": world,
        "layers": layers,
        "forward": forward.n,
        "backward": backward.n,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--src", default=None, help="another checkout whose seqpar_hf to measure (default: this one)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    from tests.helpers.spawn import spawn

    rows = []
    for world in args.world:
        for mode, ring in (("ulysses", None), ("ring", None)) + ((("hybrid", 2),) if world == 4 else ()):
            rows.append(spawn(count, world, world, mode, ring, args.layers, args.src, timeout=600)[0])
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
