"""What offloading the checkpointed layer inputs costs outside the device: host memory per node and PCIe traffic
per step, and whether the copies hide behind the compute they overlap (one layer's forward per layer's copy).

The assumptions are stated, not measured: PCIe_BYTES_PER_S per rank and direction (Gen4 x16 is 32 GB/s raw;
~25 GB/s is what a copy from pinned memory gets, and two GPUs sharing a switch halve it), the achieved dense
bf16 throughput of an H100 (~40% of its 989 TFLOP/s), and 8 ranks per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory import Layout, Model

PCIE_BYTES_PER_S = 25e9
ACHIEVED_FLOPS = 400e12
RANKS_PER_NODE = 8


@dataclass
class Traffic:
    host_bytes_per_node: float  # every rank's checkpointed layer inputs, on its node's host memory
    pcie_bytes_per_step: float  # per rank, both directions (to host in the forward, back in the backward)
    copy_seconds: float  # one layer's input, one way
    layer_seconds: float  # one layer's forward on this rank (the compute a copy overlaps)

    @property
    def hidden(self) -> bool:
        return self.copy_seconds <= self.layer_seconds


def traffic(model: Model, layout: Layout, seq_len: int, gpus: int, act_bytes: int, batch: int = 1) -> Traffic:
    m, sp, tp = model, layout.sp, layout.tp
    local = batch * -(-seq_len // sp)  # tokens per rank
    layer_input = local * m.hidden * act_bytes / tp  # [b, s/sp, h]: the residual stream between layers (TP+SP: / tp)
    per_rank = m.layers * layer_input
    # a layer's forward on this rank: its matmuls over the local tokens, and causal attention of the local queries
    # against the whole sequence (Ulysses: all tokens of heads/sp; ring: local queries, all keys: the same count)
    flops = 2 * local * m.layer_params / tp + 2 * local * seq_len * m.q_dim / tp
    return Traffic(
        host_bytes_per_node=per_rank * min(gpus, RANKS_PER_NODE),
        pcie_bytes_per_step=2 * per_rank,
        copy_seconds=layer_input / PCIE_BYTES_PER_S,
        layer_seconds=flops / ACHIEVED_FLOPS,
    )


def describe(t: Traffic) -> str:
    gib = 1024**3
    verdict = (
        "hidden behind the compute"
        if t.hidden
        else "SLOWER than the compute it overlaps: the step waits for PCIe (offload only what must go)"
    )
    return (
        f"offload: {t.host_bytes_per_node / gib:.1f} GiB of pinned host memory per node ({RANKS_PER_NODE} ranks), "
        f"{t.pcie_bytes_per_step / gib:.1f} GiB over PCIe per rank and step; a layer's copy takes "
        f"{t.copy_seconds * 1e3:.1f} ms, its forward {t.layer_seconds * 1e3:.1f} ms: {verdict} (assumed "
        f"{PCIE_BYTES_PER_S / 1e9:g} GB/s per rank and direction, {ACHIEVED_FLOPS / 1e12:g} TFLOP/s achieved)"
    )
