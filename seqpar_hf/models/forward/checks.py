"""Cheap replica-wide check that every rank that must hold the same batch got it, with the same settings
and the same weights.

The ranks of a replica (the SP group, times TP) must pass the same, full batch with the same settings.
If they do not (a sampler that shards by world rank, a collator with randomness, a setting passed on one
rank, a model switched to another mode or attention on one rank), each rank would shard a different
sequence or take different collectives: a silent wrong result, or a hang. Before any other collective,
the patched forward all-gathers a small fingerprint and raises the same error on every rank, naming the
field and every rank's value:
- per input tensor: presence, dtype, number of dims, the first two sizes, a position-weighted checksum;
- per forward: the training mode, the layout (sizes and which layout object of the sequence every rank
  built), the attention implementation the model's layers select, the tiled-loss settings,
  `num_items_in_batch`, `label_smoothing`, `logits_to_keep`, `output_hidden_states` / `output_attentions`,
  the tiled MLP and the activation offload (with how many layers are checkpointed: a rank without
  checkpointing refuses the offload after this check, never alone before it);
- the call: which call this is (a forward or `generate`: a rank in one and a rank in the other is an
  error that says so), a checksum of the model's weights (`replica_weights`: ranks that hold different
  weights have diverged), and `generate`'s own values (`generation_check`; zeros in a forward).
Every call exchanges the same structure, so ranks in different calls read each other's rows correctly.
The validation's extremes of the batch (`validate.extremes`) travel in the same all-gather (not
compared: they follow from the batch), so a forward reads back both in one host sync.

Cost: one all-gather over the replica of (11 tensors + 4 settings rows + 2 call rows + 2 rows of extremes)
x 6 int64 = 912 bytes per rank, and the weights' checksum (`replica_weights`: some microseconds of host time
per parameter, whatever its size).
"""

from __future__ import annotations

import struct

import torch

from ... import _compat
from ...parallel.agree import explain_timeout
from ...parallel.comm import all_gather_into, group_size
from ...parallel.layout import MODES
from . import replica_weights, validate
from .state import ATTN_DECODE_NAME, ATTN_NAME

FIELDS = (
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "labels",
    "shift_labels",
    "cu_seq_lens_q",
    "decoder_input_ids",
    "decoder_inputs_embeds",
    "decoder_attention_mask",
    "decoder_position_ids",
)
_SLOTS = 6  # present, dtype, ndim, dim 0, dim 1, checksum
_DTYPE_LIST = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_DTYPES = {dt: i for i, dt in enumerate(_DTYPE_LIST)}
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# the settings, each a few int64 slots: name -> number of slots
SETTINGS = {
    "model.training": 1,
    "layout": 6,
    "attention implementation": 1,
    "tiled loss": 3,
    "num_items_in_batch": 2,
    "label_smoothing": 1,
    "logits_to_keep": 1,
    "output_hidden_states": 1,
    "output_attentions": 1,
    "lm_loss": 1,
    "tiled_mlp": 2,
    "offload_activations": 2,
    "token mixers": 2,
}
_SETTING_ROWS = -(-sum(SETTINGS.values()) // _SLOTS)  # the settings' slots, padded with zeros to whole rows
_SETTING_SLOTS = _SETTING_ROWS * _SLOTS
# the call's 2 rows: [call, weights (replicated, sharded, shard key, parameters), 0], [generate's 4 values, 0, 0]
FORWARD, GENERATE = 1, 2
_CALLS = {FORWARD: "a forward", GENERATE: "generate"}
_CALL_SLOTS = 2 * _SLOTS
CALL_ROW, GENERATE_ROW = len(FIELDS) + _SETTING_ROWS, len(FIELDS) + _SETTING_ROWS + 1
COMPARED = len(FIELDS) + _SETTING_ROWS + 2  # rows compared; then EXTRA_ROWS of values that ride along
EXTRA_ROWS = 2  # validate.extremes: 5 tensors x (min, max)


def float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def checksum(x: torch.Tensor) -> torch.Tensor:
    """Exact, order-sensitive integer checksum (floats by their bits)."""
    flat = x.detach().contiguous().reshape(-1)
    if flat.dtype.is_floating_point:
        flat = flat.view(_INT_VIEW[flat.element_size()])
    weights = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return (flat.long() * weights).sum()


def call_values(call: int, model, device, generate: list | None = None) -> list:
    """The call's 2 rows of slots (flat): which call, the weights' checksums of `model`, `generate`'s values."""
    weights = replica_weights.checksums(model, device) if model is not None else [0, 0, 0, 0]
    return [call, *weights, 0, *(generate or [0] * 4), 0, 0]


def fingerprint(inputs: dict, settings: dict, device, call: list | None = None) -> torch.Tensor:
    """[COMPARED, _SLOTS] int64: one row per input tensor, then the settings' slots, then the call's
    (`call_values`; default: a forward, no weights). Built on the host in one piece and copied once; the
    checksums and device scalars are placed on the device."""
    call = call_values(FORWARD, None, device) if call is None else call
    assert len(call) == _CALL_SLOTS
    meta: list[list[int]] = []
    sums: list[torch.Tensor | None] = []
    for name in FIELDS:
        x = inputs.get(name)
        if isinstance(x, torch.Tensor):
            shape = list(x.shape) + [-1, -1]
            meta.append([1, _DTYPES.get(x.dtype, 99), x.dim(), shape[0], shape[1]])
            sums.append(checksum(x).to(device))
        else:
            meta.append([0] * (_SLOTS - 1))
            sums.append(None)
    flat = [v for name in SETTINGS for v in settings[name]]
    flat += [0] * (_SETTING_SLOTS - len(flat)) + call
    values = [v for row in meta for v in row] + [0 if isinstance(v, torch.Tensor) else int(v) for v in flat]
    host = torch.tensor(values, dtype=torch.long).to(device)  # one copy to the device
    zero = torch.zeros((), dtype=torch.long, device=device)
    checksums = torch.stack([zero if c is None else c for c in sums])  # [len(FIELDS)]
    tensors = torch.cat([host[: len(meta) * (_SLOTS - 1)].view(len(meta), _SLOTS - 1), checksums[:, None]], 1)
    settings_row = host[len(meta) * (_SLOTS - 1) :].clone()
    for i, v in enumerate(flat):
        if isinstance(v, torch.Tensor):  # a device scalar (num_items_in_batch, checksums): placed without a host sync
            settings_row[i] = v.detach().to(device).reshape(())
    return torch.cat([tensors.flatten(), settings_row]).view(-1, _SLOTS)


def forward_settings(
    state, training: bool, kwargs: dict, num_items=None, label_smoothing=0.0, lm_loss: bool = False
) -> dict:
    """The settings of one forward that change its numbers or its collectives (see the module doc)."""
    layout, tiled = state.layout, state.tiled
    s = layout.sizes
    items: tuple[int, int | torch.Tensor]
    if num_items is None:
        items = (0, 0)
    elif isinstance(num_items, torch.Tensor):
        items = (2, num_items.double().view(torch.int64)) if num_items.is_floating_point() else (1, num_items.long())
    else:
        items = (2, float_bits(num_items)) if isinstance(num_items, float) else (1, int(num_items))
    keep = kwargs.get("logits_to_keep", 0)
    return {
        "model.training": (int(training),),
        "layout": (MODES.index(s.mode), s.sp_size, s.ring_size, s.tp_size, s.world_size, layout.serial),
        "attention implementation": (attention_code(attention_in_use(state)),),
        "tiled loss": ({False: 0, True: 1}.get(tiled.setting, 2), tiled.min_elements, tiled.chunk_elements),
        "num_items_in_batch": items,
        "label_smoothing": (float_bits(label_smoothing or 0.0),),
        "logits_to_keep": (keep if isinstance(keep, int) else -1,),
        "output_hidden_states": (int(bool(kwargs.get("output_hidden_states"))),),
        "output_attentions": (int(bool(kwargs.get("output_attentions"))),),
        "lm_loss": (int(lm_loss),),
        # tiling changes the rounding; offload needs checkpointing on (a rank without it refuses the forward)
        "tiled_mlp": (state.tiled_mlp_setting, len(state.tiled_mlps)),
        "offload_activations": (
            (0, 0) if state.offload_layers is None else (1, state.offload_layers.checkpointed() if training else 0)
        ),
        # each rank decides its mixers' ways at patch_model (a fused kernel checked on its own device): the ways
        # choose the collectives
        "token mixers": tuple(sum(way == w for way in state.mixers.values()) for w in ("sequence", "heads")),
    }


def attention_in_use(state):
    """The attention implementation the patched model's attention layers select now: "seqpar_hf" unless
    it was changed after patch_model (`set_attn_implementation`, `config._attn_implementation = ...`)."""
    for site in state.family.attention:
        name = _compat.attn_implementation(site.module.config)
        if name not in (ATTN_NAME, ATTN_DECODE_NAME):  # the decode name: generate under SP selects it
            return name
    return ATTN_NAME


def require_sp_attention(state) -> None:
    """Raise (the same on every rank: the fingerprint compared it) if the layers would run plain attention."""
    name = attention_in_use(state)
    if name != ATTN_NAME:
        raise RuntimeError(
            f"the attention implementation of this patched model was changed to {name!r} after patch_model "
            "(set_attn_implementation or config._attn_implementation): its layers would run plain attention on "
            f"their shard of the sequence, a wrong result. Set it back (model.set_attn_implementation({ATTN_NAME!r}))"
            "; to change the implementation used without SP (generation, sp_disabled), call "
            "seqpar_hf.unpatch_model(model), set it, and patch the model again"
        )


def check_same_batch(
    inputs: dict, settings: dict, group, device, extra: torch.Tensor | None = None, call: list | None = None
) -> list[int]:
    """Raise on every rank of `group` if their batches, settings or weights differ (one small all-gather).
    `call`: `call_values` (default: a forward, no weights). `extra` (int64, at most EXTRA_ROWS rows, not
    compared) rides along; returns this rank's `extra` values (one host sync)."""
    extra = torch.zeros(0, dtype=torch.long, device=device) if extra is None else extra.to(device)
    pad = EXTRA_ROWS * _SLOTS - extra.numel()
    assert pad >= 0, extra.numel()
    tail = torch.cat([extra, extra.new_zeros(pad)]).view(-1, _SLOTS)
    mine = torch.cat([fingerprint(inputs, settings, device, call), tail])  # [COMPARED + EXTRA_ROWS, _SLOTS]
    everyone = exchange(mine, group, "in the batch check at the start of a forward")
    own = [v for row in everyone[_rank_in(group) if len(everyone) > 1 else 0][COMPARED:] for v in row][: extra.numel()]
    if agree(everyone):
        return own
    problems, weights = batch_problems(everyone), weights_problems(everyone)
    batch = (
        (
            "ranks of one replica (the ranks that must pass the same batch: an SP group, times TP) got different "
            "batches or settings (" + "; ".join(problems) + "). Every rank of a replica must pass the same, full "
            "batch with the same arguments and model state: shard data over layout.dp_size / layout.dp_rank, not "
            "over the world (SequenceParallelTrainer does this)."
        )
        if problems
        else ""
    )
    raise (ValueError if problems else RuntimeError)(" ".join(m for m in (batch, weights) if m))


def exchange(mine: torch.Tensor, group, doing: str) -> list:
    """All-gather `mine` over `group` and read it back (one host sync): [ranks][rows][_SLOTS]. Every call
    (forward, generate) sends the same structure, [COMPARED + EXTRA_ROWS, _SLOTS], so ranks in different
    calls read each other correctly and raise the same error, saying which rank is in which call."""
    assert tuple(mine.shape) == (COMPARED + EXTRA_ROWS, _SLOTS), tuple(mine.shape)
    n = group_size(group)
    if n == 1:
        return [mine.tolist()]
    gathered = mine.new_empty((n, *mine.shape))
    with explain_timeout(doing):
        all_gather_into(gathered, mine.unsqueeze(0), group=group)  # [n, rows, _SLOTS]
    everyone = gathered.tolist()
    calls = [rows[CALL_ROW][0] for rows in everyone]
    if len(set(calls)) > 1:
        raise RuntimeError(
            "ranks of one replica are in different calls of the patched model ("
            + ", ".join(f"rank {r} is in {_CALLS.get(c, 'another call')}" for r, c in enumerate(calls))
            + "). Every rank of a "
            "replica must make the same calls with the same batch (every forward, and generate, on every rank "
            "together); otherwise their collectives would mix or hang."
        )
    return everyone


def _comparable(rows: list) -> list:
    """The compared rows, without the sharded weights' checksum and key (compared among ranks that share them)."""
    call = list(rows[CALL_ROW])
    call[2] = call[3] = 0
    return rows[:CALL_ROW] + [call] + rows[CALL_ROW + 1 : COMPARED]


def agree(everyone: list) -> bool:
    first = _comparable(everyone[0])
    return all(_comparable(rows) == first for rows in everyone) and not weights_problems(everyone)


def weights_problems(everyone: list) -> str:
    """The message when the ranks' weights differ ('' when they agree)."""
    found = replica_weights.problems([rows[CALL_ROW][1:5] for rows in everyone])
    return (
        (
            f"ranks of one replica hold different weights ({'; '.join(found)}): the replica has diverged. "
            f"{replica_weights.ADVICE}"
        )
        if found
        else ""
    )


def _rank_in(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _per_rank(values: list) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def batch_problems(everyone: list) -> list[str]:
    """What differs between the ranks' rows (`exchange`) in the inputs and the settings, one phrase each."""
    problems = []
    for i, name in enumerate(FIELDS):
        per_rank = [rows[i] for rows in everyone]
        if all(r == per_rank[0] for r in per_rank):
            continue
        if len({r[0] for r in per_rank}) > 1:
            problems.append(f"{name} given on ranks {[k for k, r in enumerate(per_rank) if r[0]]} only")
        elif len({r[1] for r in per_rank}) > 1:
            problems.append(
                f"{name} dtypes differ: "
                + _per_rank([_DTYPE_LIST[r[1]] if r[1] < len(_DTYPE_LIST) else "other" for r in per_rank])
            )
        elif len({tuple(r[2:5]) for r in per_rank}) > 1:
            problems.append(
                f"{name} shapes differ: "
                + _per_rank([tuple(d for d in r[3:5] if d >= 0) + (("...",) if r[2] > 2 else ()) for r in per_rank])
            )
        else:
            problems.append(f"{name} values differ")
    flat = [[v for row in rows[len(FIELDS) : len(FIELDS) + _SETTING_ROWS] for v in row] for rows in everyone]
    start = 0
    for name, width in SETTINGS.items():
        per_rank = [tuple(f[start : start + width]) for f in flat]
        start += width
        if len(set(per_rank)) > 1:
            problems.append(f"{name} differs: " + _per_rank([_describe(name, v) for v in per_rank]))
    return problems


def _describe(name: str, value: tuple):
    if name == "layout":
        mode, sp, ring, tp, world, serial = value
        return (
            f"layout #{serial} of the process ({MODES[mode] if 0 <= mode < len(MODES) else mode}, sp {sp}, "
            f"ring {ring}, tp {tp}, world {world})"
        )
    if name == "attention implementation":
        return attention_name(value[0])
    if name == "tiled loss":
        return f"({('False', 'True', 'auto')[value[0]]}, min {value[1]}, chunk {value[2]})"
    if name == "num_items_in_batch":
        return None if value[0] == 0 else value[1] if value[0] == 1 else _from_bits(value[1])
    if name == "label_smoothing":
        return _from_bits(value[0])
    if name == "tiled_mlp":
        setting = {0: "False", -1: "True", -2: "'auto'"}.get(value[0], f"{value[0]} tokens")
        return f"{setting} ({value[1]} MLPs tiled)"
    if name == "offload_activations":
        return f"{bool(value[0])} ({value[1]} layers checkpointed)" if value[0] else "False"
    if name == "token mixers":
        return f"{value[0]} split along the sequence, {value[1]} by heads"
    return value[0] if len(value) == 1 else value


_ATTENTION = (ATTN_NAME, "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", None)


def attention_code(name) -> int:
    return _ATTENTION.index(name) if name in _ATTENTION else 99


def attention_name(code: int):
    return _ATTENTION[code] if 0 <= code < len(_ATTENTION) else "another implementation"


def check_forward(
    state,
    kwargs: dict,
    training: bool,
    device,
    labels=None,
    shift_labels=None,
    num_items=None,
    label_smoothing=0.0,
    lm_loss: bool = False,
    compare: bool = True,
) -> None:
    """Before sharding, on every rank of the replica: the fingerprint (a mismatch raises everywhere), then
    the attention implementation, then the full batch's validation (`validate`), all from one all-gather
    and one host sync. Without `check_inputs` (or `compare`: the caller compared the inputs already), the
    validation alone (one host sync, no collective)."""
    extra = validate.extremes(state.family.kind, kwargs, labels, shift_labels, device)
    if state.check_inputs and compare:
        settings = forward_settings(state, training, kwargs, num_items, label_smoothing, lm_loss)
        values = check_same_batch(
            {**kwargs, "labels": labels, "shift_labels": shift_labels},
            settings,
            state.layout.replica_group,
            device,
            extra,
            call_values(FORWARD, state.family.pretrained, device),
        )
    else:
        values = extra.tolist()
    require_sp_attention(state)
    validate.check(state.family, kwargs, labels, shift_labels, values, outer=lm_loss)
