"""Peak bytes per rank with and without the offload of checkpointed layer inputs and the tiled MLP
(seqpar_hf/memory/), on CPU at a small scale: one training step (forward and backward) of a tiny Llama with
grouped-query attention (hidden 512, 8 layers, 4/2 heads, ffn 4096: 8x hidden, wider than Llama's 3.5x, so that
the MLP's share of a CPU step, whose attention keeps its [s, s] scores, resembles a flash-attention GPU's) at sp=1.

Measured with a memory tracker, not timed: a TorchDispatchMode that counts every storage an operation
creates until it is freed (the parameters, made before, are not counted; their gradients are): the step's
peak. The offload's host copies are not counted (on a GPU they live in
host memory; here host and "device" are the same RAM, which the same code path copies through). Under SP
each rank's layer inputs are already 1/sp of these.

    python -m benchmarks.activation_offload            # 2048 tokens, a few minutes on 2 CPU cores
    python -m benchmarks.activation_offload --quick    # 512 tokens
"""

from __future__ import annotations

import argparse
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import seqpar_hf
from benchmarks.common import ModelSpec, build_model, enable_checkpointing, environment, fmt_bytes, make_batch, table
from benchmarks.publish import output_options, publish

SPEC = ModelSpec("llama-small-wide-mlp", "causal", d_model=512, layers=8, heads=4, kv_heads=2, ffn=4096)
VARIANTS = [  # (name, checkpointing, patch options)
    ("no checkpointing", False, {}),
    ("checkpointing", True, {}),
    ("checkpointing + offload", True, dict(offload_activations=True)),
    ("checkpointing + tiled MLP", True, dict(tiled_mlp=True)),
    ("checkpointing + both", True, dict(offload_activations=True, tiled_mlp=True)),
]


class PeakTracker(TorchDispatchMode):
    """Live bytes of the storages operations create (each storage once), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.paused = 0, 0, False
        self.seen: set[int] = set()

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._add(t)
        return out

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


def _uncounted_host_copies(model, tracker: PeakTracker) -> None:
    """The offload's host copies are host memory: created with the tracker paused."""
    offload = model._seqpar_state.offload
    if offload is None:
        return

    def pack(t):
        with tracker.pause():
            return offload.pack(t)

    offload.hooks = torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack)


def step_peak(spec, seq_len: int, checkpointing: bool, options: dict) -> dict:
    model = build_model(spec, seq_len)
    if checkpointing:
        enable_checkpointing(model)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1), tiled_loss=True, **options)
    model.train()
    batch = make_batch(spec, seq_len)
    tracker = PeakTracker()
    _uncounted_host_copies(model, tracker)
    with tracker:
        loss = model(**batch).loss
        after_forward = tracker.live  # what the forward left for the backward: the saved activations
        loss.backward()
    offload = model._seqpar_state.offload
    return {
        "peak_bytes": tracker.peak,
        "after_forward_bytes": after_forward,
        "offloaded_bytes": offload.moved_bytes if offload is not None else 0,
        "tiled_mlps": len(model._seqpar_state.tiled_mlps),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="512 tokens")
    output_options(parser, "activation_offload", figure=False)
    args = parser.parse_args(argv)
    seq_len = 512 if args.quick else args.seq_len
    spec = SPEC
    torch.set_num_threads(2)
    records = []
    for name, checkpointing, options in VARIANTS:
        measured = step_peak(spec, seq_len, checkpointing, options)
        records.append(dict(variant=name, model=spec.name, seq_len=seq_len, **measured, environment=environment()))
    base = records[1]["peak_bytes"]
    rows = [
        dict(
            variant=r["variant"],
            peak=fmt_bytes(r["peak_bytes"]),
            kept=fmt_bytes(r["after_forward_bytes"]),
            vs=f"{r['peak_bytes'] / base:.2f}",
            offloaded=fmt_bytes(r["offloaded_bytes"]),
        )
        for r in records
    ]
    print(f"{spec.name}, {seq_len} tokens, one step (sp=1, fp32, tiled loss)")
    print(
        table(
            rows,
            [
                ("variant", "variant"),
                ("peak", "peak"),
                ("x checkpointing", "vs"),
                ("kept after the forward", "kept"),
                ("to host", "offloaded"),
            ],
        )
    )
    publish("activation_offload", records, args)
    return records


if __name__ == "__main__":
    main()
