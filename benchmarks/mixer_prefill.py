"""Generation's prompt forward with token mixers under SP: the mixer split along the sequence (each rank its own
tokens, the scan's final state and the convolution's last inputs gathered into the cache) against the mixer run
whole (every rank the whole prompt), per rank: the peak bytes of `generate(prompt, 1 new token)` and the mixer's
prompt forward time.

    python -m benchmarks.mixer_prefill           # 8K / 16K / 32K tokens, sp 2 and 4; ~5 min on 2 CPU cores
    python -m benchmarks.mixer_prefill --quick   # 1K tokens, prints the table, writes nothing

The model: benchmarks/mixers.py's Qwen3.5 (hidden 512, a gated DeltaNet layer then a full-attention one, key heads
4 / value heads 8 of width 64), fp32, batch 1, eval. One rank of an sp-way group runs in one process joined to a
fake process group (benchmarks/fake_group.py: collectives move nothing, received buffers are zeroed, so the
tokens are not the model's; sizes and memory are): rank 1, one thread. The peak is that of the bytes the generate
call allocates (every storage its ops create, from creation until freed; the weights not included); the time
leaves out the communication. sp = 1 is the unpatched model.
"""

from __future__ import annotations

import argparse
import gc
import time
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from benchmarks.common import environment, fmt_bytes, table
from benchmarks.publish import json_path, output_options, publish, write_json

MIXER = "model.layers.0.linear_attn"


def measure(seq_len: int, sp: int, path: str) -> dict:
    """One rank's peak and mixer prompt-forward time (runs in its own process)."""
    import seqpar_hf
    from benchmarks import fake_group
    from benchmarks.instruments import CollectiveTap
    from benchmarks.mixers import build
    from seqpar_hf.models.forward.state import state_of
    from seqpar_hf.models.mixers import install

    torch.set_num_threads(1)
    model = build(seq_len + 8).eval()
    if path == "whole":  # as where the split prompt forward is not proven: the mixer runs whole in it
        install._prefill = lambda *args: False
    if sp > 1:
        fake_group.join(sp, rank=1)
        seqpar_hf.patch_model(model, fake_group.layout(sp_size=sp), check_inputs=False)
        wrapper = model.get_submodule(MIXER).forward
        assert set(state_of(model).mixers.values()) == {"sequence"} and wrapper.prefill == (path == "sequence")
    ids = torch.randint(1, 1024, (1, seq_len), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 1}
    times: list = []
    mixer = model.get_submodule(MIXER)
    mixer.register_forward_pre_hook(lambda *_: times.append(-time.perf_counter()))
    mixer.register_forward_hook(lambda *_: times.append(times.pop() + time.perf_counter()))
    gc.collect()
    with CollectiveTap(fake_group.zero_received), PeakBytes() as tracked:
        model.generate(**inputs)
    peak = tracked.peak
    split = getattr(model.get_submodule(MIXER).forward, "prompts_split", 0)
    return {
        "seq_len": seq_len,
        "sp": sp,
        "path": path if sp > 1 else "one process",
        "peak_bytes": peak,
        "mixer_prompt_s": times[0],
        "prompts_split": split,
    }


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes held by the storages the ops run inside it create (each counted from its creation
    until it is freed): what generate allocates on top of the weights."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                storage = t.untyped_storage()
                if storage not in self.seen and storage.nbytes():
                    self.seen[storage] = True
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true")
    output_options(parser, "mixer_prefill", figure=False)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_lens = [1024]
    from tests.helpers.spawn import spawn

    print(environment())
    path = json_path(args, "mixer_prefill")
    records = []
    for seq_len in args.seq_lens:
        for sp in args.sp:
            for way in ("sequence", "whole") if sp > 1 else ("one",):
                rec = spawn(_solo, 1, seq_len, sp, way, timeout=3600.0)[0]
                print(f"{seq_len} tokens sp={sp} {rec['path']}: peak {fmt_bytes(rec['peak_bytes'])}, "
                      f"mixer prompt forward {rec['mixer_prompt_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
                records.append(rec)
                if path:
                    write_json(path, records)
    one = {r["seq_len"]: r for r in records if r["sp"] == 1}
    rows = [
        {
            **r,
            "peak": fmt_bytes(r["peak_bytes"]),
            "share": f"{r['peak_bytes'] / one[r['seq_len']]['peak_bytes']:.2f}" if r["seq_len"] in one else "",
            "fwd": f"{r['mixer_prompt_s'] * 1e3:.0f} ms",
        }
        for r in records
    ]
    print(
        table(
            rows,
            [
                ("tokens", "seq_len"),
                ("sp", "sp"),
                ("mixer in the prompt forward", "path"),
                ("peak / rank (generate)", "peak"),
                ("vs one process", "share"),
                ("mixer prompt forward", "fwd"),
            ],
        )
    )
    publish("mixer_prefill", records, args)


def _solo(seq_len: int, sp: int, path: str) -> dict:
    """In a spawned process: leave the spawn's gloo group for the fake one (`measure` joins it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return measure(seq_len, sp, path)


if __name__ == "__main__":
    main()
