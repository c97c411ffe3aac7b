"""The lengths of the dry run's sequences (models/proof/probe.py), fitted to the model.

The dry run tells a sequence dim from the others by its size (models/proof/signatures.py), so its lengths and
the lengths of their 2-way shards must be sizes no other dim has: 25 tokens (the source of an
encoder-decoder too) and 21 target tokens, whose shards are 13, 11, 14 and 12. They must also fit the
model's absolute position tables: a GPT-2 with n_positions=16 cannot take 25 tokens, so its dry run is
shorter, the longest that fits whose sizes and shard sizes are no size its config names. A table too
short for any such run (under MIN_LENGTH tokens) is refused, naming the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedModel

from .probe_checks import Refusal

DEFAULT = (25, 21)
MIN_LENGTH, MIN_TARGET = 8, 6  # 3 left-padded tokens leave a real one in each zigzag chunk of a 2-way ring


@dataclass(frozen=True)
class Sizes:
    causal: int  # a decoder-only sequence, or an encoder-decoder's source
    target: int  # an encoder-decoder's target


def _shards(length: int, causal: bool) -> tuple[int, int]:
    """(Ulysses, ring) local lengths of a 2-way split: padded to 2, or to 4 for a causal zigzag."""
    return -(-length // 2), (-(-length // 4) * 2 if causal else -(-length // 2))


def all_configs(config) -> list:
    out: list = []
    todo = [config]
    while todo:
        c = todo.pop()
        if c is None or any(c is o for o in out):
            continue
        out.append(c)
        todo += [getattr(c, k, None) for k in getattr(c, "sub_configs", {}) or {}]
    return out


def _config_ints(config) -> set[int]:
    out = set()
    for c in all_configs(config):
        for value in vars(c).values():
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                    out.add(v)
    return out


def _position_counts(config) -> set[int]:
    return {
        v
        for c in all_configs(config)
        for k, v in vars(c).items()
        if isinstance(v, int) and ("position" in k or k in ("n_ctx", "max_seq_len"))
    }


def position_room(model: PreTrainedModel) -> tuple[int, str, int] | None:
    """(tokens, path, rows) of the shortest absolute position table of `model` takes: an nn.Embedding other than
    the token embeddings with as many rows (past its `offset`) as a config field about positions says;
    a table with a padding row keeps the rows up to it for padding-aware positions (RoBERTa's)."""
    counts = _position_counts(model.config)
    tokens = model.get_input_embeddings()
    best = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or module is tokens:
            continue
        offset = int(getattr(module, "offset", 0) or 0)
        if module.num_embeddings - offset not in counts:
            continue
        room = module.num_embeddings - offset - (module.padding_idx + 1 if module.padding_idx is not None else 0)
        if best is None or room < best[0]:
            best = (room, path, module.num_embeddings - offset)
    return best


def choose(model: PreTrainedModel, kind: str) -> Sizes:
    """The dry run's lengths for `model` ("causal" or "seq2seq"); Refusal when its tables are too short."""
    room = position_room(model)
    if room is None or room[0] >= DEFAULT[0]:
        return Sizes(*DEFAULT)
    taken = _config_ints(model.config) - _position_counts(model.config)  # table sizes are no activation's dim
    for length in range(room[0], MIN_LENGTH - 1, -1):
        full = _shards(length, causal=kind == "causal")
        if kind == "causal":
            if not ({length, *full} & taken):
                return Sizes(length, DEFAULT[1])
            continue
        for target in range(length - 1, MIN_TARGET - 1, -1):
            part = _shards(target, causal=True)
            runs = [(length, target), (full[0], part[0]), (full[1], part[1])]  # the full run, then each split
            if all(a != b for a, b in runs) and not ({length, target, *full, *part} & taken):
                return Sizes(length, target)
    raise Refusal(
        room[1],
        f"holds {room[2]} positions, too few for the dry run that proves the model shards "
        f"exactly (it needs {MIN_LENGTH} tokens or more, at lengths no size of the model has)",
    )
