"""Per-rank work of causal ring attention: contiguous vs zigzag sharding (no process group needed).

Counts, for every rank of an SP group, the (query, key) pairs causal attention must score
(q >= k) on that rank, and the pairs the ring kernel actually computes (whole blocks, or the half
blocks of the zigzag schedule in seqpar_hf/ring.py). The step time of a ring is set by its slowest
rank, so the figure of merit is max / mean.

    python -m benchmarks.ring_balance            # markdown table
"""

from __future__ import annotations

import argparse

import torch

from seqpar_hf.parallel.sharding import ShardPlan


def needed_pairs(plan_index: torch.Tensor, key_index: torch.Tensor) -> int:
    return int((plan_index[:, None] >= key_index[None, :]).sum())


def rank_work(seq_len: int, sp: int, zigzag: bool) -> list[tuple[int, int]]:
    """[(needed pairs, computed pairs)] per rank."""
    plans = [ShardPlan.build(seq_len, sp, r, sp, zigzag) for r in range(sp)]
    index = [p.global_index() for p in plans]
    out = []
    for r in range(sp):
        needed = sum(needed_pairs(index[r], index[j]) for j in range(sp))
        s = index[r].numel()
        if zigzag:  # own block causal (~half), every other block half: seqpar_hf/ring.py::_block
            computed = s * (s + 1) // 2 + (sp - 1) * s * s // 2
        else:  # contiguous: blocks from earlier ranks whole, own block causal, later ranks skipped
            computed = r * s * s + s * (s + 1) // 2
        out.append((needed, computed))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    print("| sp | sharding | needed pairs, slowest rank / mean | computed pairs, slowest rank / mean |")
    print("|---|---|---|---|")
    for sp in (2, 4, 8):
        for zigzag in (False, True):
            work = rank_work(args.seq_len, sp, zigzag)
            needed = [w[0] for w in work]
            computed = [w[1] for w in work]
            print(
                f"| {sp} | {'zigzag' if zigzag else 'contiguous'} | {max(needed) / (sum(needed) / sp):.3f} | "
                f"{max(computed) / (sum(computed) / sp):.3f} |"
            )


if __name__ == "__main__":
    main()
