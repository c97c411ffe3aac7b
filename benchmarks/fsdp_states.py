"""Model-state bytes per rank with FSDP2 over dp x sp, against 16 P / (dp x sp) (fp32 AdamW).

    python -m benchmarks.fsdp_states          # < 1 min on 2 CPU cores

The bench-44m model of benchmarks/longest_sequence.py (P = 44.04M parameters), patched with
seqpar_hf at each layout and sharded with `seqpar_hf.training.fsdp.shard_model` (every decoder
layer, then the root, over the layout's dp x sp ranks). Rank 0 of the layout runs in one process
joined to a fake process group of the layout's world size (only sizes are meaningful), takes one
AdamW step on 64 tokens per rank, and counts what it holds afterwards: its parameter shards, its
gradient shards (before zero_grad) and the optimizer's state tensors (exp_avg, exp_avg_sq, step).
Writes benchmarks/results/fsdp_states.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import fake_group
from benchmarks.longest_sequence import COMMON, SIZES, batch, init_group

LAYOUTS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (2, 4), (8, 1)]  # (sp, dp)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def count(sp: int, dp: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import seqpar_hf
    from seqpar_hf.training.fsdp import shard_model

    init_group(sp * dp)
    config = LlamaConfig(**{**COMMON, **SIZES["bench-44m"]})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    model.set_attn_implementation("sdpa")
    P = sum(p.numel() for p in model.parameters())
    layout = fake_group.layout(sp_size=sp)
    seqpar_hf.patch_model(model, layout, check_inputs=False)
    if sp * dp > 1:
        shard_model(model, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(**batch(64 * sp, "cpu")).loss.backward()
    optimizer.step()
    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    states = sum(
        local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return dict(
        sp=sp,
        dp=dp,
        P=P,
        params=params,
        grads=grads,
        states=states,
        total=params + grads + states,
        formula=16 * P / (sp * dp),
    )


def main():
    rows = [count(sp, dp) for sp, dp in LAYOUTS]
    if dist.is_initialized():
        dist.destroy_process_group()
    lines = [
        f"Model-state bytes per rank, FSDP2 over dp x sp (bench-44m, P = {rows[0]['P'] / 1e6:.2f}M, fp32 AdamW; MiB)",
        "",
        "| sp | dp | ranks sharing | parameters | gradients | AdamW states | total | 16 P / (dp x sp) | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sp']} | {r['dp']} | {r['sp'] * r['dp']} | {r['params'] / 2**20:.1f} | "
            f"{r['grads'] / 2**20:.1f} | {r['states'] / 2**20:.1f} | {r['total'] / 2**20:.1f} | "
            f"{r['formula'] / 2**20:.1f} | {r['total'] / r['formula']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    out = Path(__file__).resolve().parent / "results" / "fsdp_states.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
