"""How an SP group scores one generation batch once, for TRL's GRPO and RLOO trainers.

The ranks of an SP group hold the same generation batch (one replica's rows). Each rank generates,
decodes and rewards a contiguous slice of those rows (`rank_rows`), as if it were one of TRL's
data-parallel processes, so every completion is generated and rewarded once; the forwards that need
the whole sequence on every rank (old and reference log-probabilities) run on the group's rows
(`group_rows`), and the scored slices are gathered back into the group's batch (`gather_rows`) for the
loss, which every rank then computes on the same rows. `ReplicaAccelerator` is the accelerator as that
loss sees it: one process per replica.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.agree import explain_timeout
from ..parallel.comm import all_gather_into, group_size
from ..parallel.layout import ParallelLayout
from .replica import one_per_replica

# How TRL pads each [rows, width] field of a scored batch (prompts on the left, completions on the right),
# with the value it pads with ("pad": the tokenizer's pad id); fields with one value per row; fields that
# are the same on every rank.
LEFT = {"prompt_ids": "pad", "prompt_mask": 0}
RIGHT = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "tool_mask": 1,
}
ROWS = ("advantages", "old_logps")
SAME = ("num_items_in_batch",)


def check_same_prompts(inputs: list, layout: ParallelLayout, device) -> None:
    """Raise ValueError on every rank of the SP group unless its ranks hold the same generation batch (the
    rows TRL's sampler gave this replica: prompts and every other column). Ranks reading different datasets
    (or another order) would each score their slice of another batch and train on a mix, silently. One
    all-gather of 2 int64 per generation batch, before any other collective of its scoring."""
    n = group_size(layout.sp_group)
    if n == 1:
        return
    plain = lambda o: o.tolist() if hasattr(o, "tolist") else type(o).__name__
    text = json.dumps(inputs, sort_keys=True, default=plain)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([len(inputs), digest], dtype=torch.long, device=device)
    everyone = mine.new_empty(n * 2)
    with explain_timeout("comparing the generation batch across the SP group"):
        all_gather_into(everyone, mine, group=layout.sp_group)  # [sp * 2]
    rows = everyone.view(n, 2).tolist()
    if all(r == rows[0] for r in rows):
        return
    raise ValueError(
        "ranks of one SP group hold different generation batches ("
        + ", ".join(f"rank {k}: {r[0]} rows, sha256 {r[1] & 0xFFFFFFFF:08x}" for k, r in enumerate(rows))
        + "). Every rank of an "
        "SP group must read the same prompts, the replica's batch, which the trainer splits among them: pass the "
        "same train_dataset / eval_dataset (same rows, same order) and the same arguments on every rank."
    )


def rank_rows(rows: int, layout: ParallelLayout) -> slice:
    """This rank's contiguous slice of a batch of `rows` rows that its SP group holds (rows % sp == 0,
    checked with the arguments)."""
    per = rows // layout.sp_size
    return slice(layout.sp_rank * per, (layout.sp_rank + 1) * per)


def gather_rows(batch: dict, layout: ParallelLayout, pad_id: int) -> dict:
    """The SP group's batch from each rank's slice, in rank order, on every rank: [b, w_rank] fields ->
    [sp * b, max w], padded as TRL pads them (so the result is what TRL builds from the whole batch)."""
    unknown = set(batch) - set(LEFT) - set(RIGHT) - set(ROWS) - set(SAME)
    if unknown:  # a field this version does not know how to pad: refuse rather than gather it wrongly
        raise ValueError(
            f"seqpar_hf cannot gather the scored batch fields {sorted(unknown)} over the SP group "
            "(a TRL version newer than this code, or multimodal / vLLM inputs, which are not supported)"
        )
    if group_size(layout.sp_group) == 1:
        return batch
    device = next(v.device for v in batch.values() if isinstance(v, torch.Tensor))
    pieces: list[Any] = [None] * layout.sp_size
    local = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    dist.all_gather_object(pieces, local, group=layout.sp_group)  # sp dicts of [b, w_rank] tensors
    out = {}
    for key in batch:
        values = [p[key] for p in pieces]
        if key in SAME:
            out[key] = batch[key]
            continue
        if key in ROWS:
            out[key] = torch.cat(values)  # sp x [b] -> [sp * b]
        else:
            side, fill = ("left", LEFT[key]) if key in LEFT else ("right", RIGHT[key])
            out[key] = _pad_cat(values, side, pad_id if fill == "pad" else fill)
        out[key] = out[key].to(device)
    return out


def _pad_cat(values: list[torch.Tensor], side: str, fill) -> torch.Tensor:
    """sp x [b, w_i] -> [sp * b, max w_i], each padded on `side` with `fill`."""
    width = max(v.shape[1] for v in values)
    padded = []
    for v in values:
        extra = width - v.shape[1]
        padded.append(torch.nn.functional.pad(v, (extra, 0) if side == "left" else (0, extra), value=fill))
    return torch.cat(padded)


def group_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, layout: ParallelLayout, pad_id: int
):
    """The SP group's rows of a scoring forward, from this rank's [b, P + C] (prompt | completion) rows:
    ([sp * b, P_max + C_max] ids, mask, C_max, this rank's rows in them)."""
    prompt_width = input_ids.shape[1] - completion_width
    rows = gather_rows(
        {
            "prompt_ids": input_ids[:, :prompt_width],
            "prompt_mask": attention_mask[:, :prompt_width],
            "completion_ids": input_ids[:, prompt_width:],
            "completion_mask": attention_mask[:, prompt_width:],
        },
        layout,
        pad_id,
    )
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)  # [sp * b, P_max + C_max]
    mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    b = input_ids.shape[0]
    return ids, mask, rows["completion_ids"].shape[1], slice(layout.sp_rank * b, (layout.sp_rank + 1) * b)


def sync_rng(layout: ParallelLayout, device: torch.device) -> None:
    """Give the ranks of the SP group the RNG state of its first rank (CPU, and `device` on CUDA): they
    shuffle the scored batch alike (TRL's `shuffle_sequence_dict`) and keep one shared stream, whatever
    their slices drew (sampling, reward functions)."""
    if group_size(layout.sp_group) == 1:
        return
    states: list[Any] = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(layout.sp_group, 0), group=layout.sp_group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


class ReplicaAccelerator:
    """The trainer's accelerator with each replica (SP x TP group) as one process: what TRL's loss reads
    (`num_processes`, `process_index`, `gather`, `reduce`) counts every replica once. Everything else is
    the accelerator's own."""

    def __init__(self, accelerator, layout: ParallelLayout):
        self._accelerator, self._layout = accelerator, layout

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def num_processes(self) -> int:
        return self._layout.dp_size

    @property
    def process_index(self) -> int:
        return self._layout.dp_rank

    def gather(self, tensor):
        return one_per_replica(self._accelerator.gather(tensor), self._layout)  # [world * n] -> [dp * n]

    def gather_for_metrics(self, data, use_gather_object: bool = False):
        return self.gather(data)  # the loss's rows are one training batch: nothing to drop

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        rows = self.gather(tensor.unsqueeze(0))  # [...] -> [dp, ...]
        out = rows.sum(0) if reduction == "sum" else rows.mean(0) if reduction == "mean" else tensor
        return out * scale
