"""Counters for what a training step saves for backward and what it communicates.

- `CollectiveTap` + `CommMeter`: every `torch.distributed` call (and the module-level aliases of those
  functions in the packages named), with the bytes it sends, per phase (forward / backward).
- `OpCommCounter`: the same at the level of the c10d ops, through a `TorchDispatchMode`: it also sees
  the `_c10d_functional` ops behind DTensor redistributions, which call no `torch.distributed` function.
- `saved_storages`: the storages autograd saves in one forward, each once, with the module that saved it.

Bytes "sent" are what leaves the rank with ring algorithms: all-to-all its input minus its own chunk,
all-gather its chunk to each of n-1 ranks, reduce-scatter (n-1)/n of its input, all-reduce 2 (n-1)/n of
the tensor, p2p what it sends. "Payload" is the Megatron paper's unit for the op-level counter and the
input chunk for the function-level one.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# ---------------------------------------------------------------------------------------------
# torch.distributed functions

COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "batch_isend_irecv",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
)


class CollectiveTap:
    """Calls `on_call(name, bound_arguments)` before every torch.distributed collective.

    Replaces the functions on `torch.distributed` and every module-level alias of them in the
    modules whose names start with one of `modules` (seqpar_hf keeps `all_gather_single` under its
    own names, bound at import). isend/irecv are left alone: P2POp checks their identity, and the ring
    only uses batch_isend_irecv. DDP's gradient all-reduce runs in C++ and is not seen.
    """

    def __init__(self, on_call, modules=("seqpar_hf",)):
        self.on_call, self.modules, self._undo = on_call, tuple(modules), []

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.on_call(name, bound.arguments)
            return fn(*args, **kwargs)

        return wrapper

    def __enter__(self):
        originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        wrappers = {n: self._wrap(n, fn) for n, fn in originals.items()}
        targets = [dist] + [
            m for name, m in list(sys.modules.items()) if m is not None and name.startswith(self.modules)
        ]
        by_id = {id(fn): n for n, fn in originals.items()}
        for module in targets:
            for attr, value in list(vars(module).items()):
                n = by_id.get(id(value))
                if n is not None:
                    setattr(module, attr, wrappers[n])
                    self._undo.append((module, attr, value))
        return self

    def __exit__(self, *exc):
        for module, attr, value in reversed(self._undo):
            setattr(module, attr, value)
        self._undo.clear()


def transfer_bytes(name: str, a: dict) -> tuple[int, int, int]:
    """(sent, received, payload) bytes of one collective call for the calling rank."""
    group = a.get("group")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if name == "all_to_all_single":
        out, inp = a["output"], a["input"]
        in_rows = a["input_split_sizes"] or [inp.shape[0] // n] * n
        out_rows = a["output_split_sizes"] or [out.shape[0] // n] * n
        row_in = inp[0].numel() * inp.element_size()
        row_out = out[0].numel() * out.element_size()
        return (sum(in_rows) - in_rows[me]) * row_in, (sum(out_rows) - out_rows[me]) * row_out, inp.nbytes
    if name == "all_to_all":
        sent = sum(t.nbytes for j, t in enumerate(a["input_tensor_list"]) if j != me)
        recv = sum(t.nbytes for j, t in enumerate(a["output_tensor_list"]) if j != me)
        return sent, recv, sent
    if name == "batch_isend_irecv":
        sent = sum(op.tensor.nbytes for op in a["p2p_op_list"] if op.op.__name__ == "isend")
        recv = sum(op.tensor.nbytes for op in a["p2p_op_list"] if op.op.__name__ == "irecv")
        return sent, recv, sent
    if name in ("all_gather_into_tensor", "all_gather_single"):
        chunk = a["input_tensor"].nbytes
        return (n - 1) * chunk, (n - 1) * chunk, chunk
    if name == "all_gather":
        chunk = a["tensor"].nbytes
        return (n - 1) * chunk, (n - 1) * chunk, chunk
    if name == "all_reduce":
        payload = a["tensor"].nbytes
        return int(2 * (n - 1) / n * payload), int(2 * (n - 1) / n * payload), payload
    tensor = next((v for v in a.values() if isinstance(v, torch.Tensor)), None)
    payload = 0 if tensor is None else tensor.nbytes
    return payload, payload, payload


class CommMeter:
    """Accumulates bytes per (phase, label, collective); the caller sets `phase` and `label`."""

    def __init__(self):
        self.phase, self.label = "forward", "other"
        self.totals = collections.defaultdict(lambda: [0, 0, 0, 0])  # sent, received, payload, calls

    def record(self, name, arguments):
        sent, recv, payload = transfer_bytes(name, arguments)
        t = self.totals[(self.phase, self.label, name)]
        t[0] += sent
        t[1] += recv
        t[2] += payload
        t[3] += 1


# ---------------------------------------------------------------------------------------------
# c10d ops


def _local(t):
    """The plain tensor holding `t`'s data on this rank: a DTensor's local tensor, an
    AsyncCollectiveTensor's result (what DTensor's functional collectives return until waited on)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t


def _group(group):
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        group = _resolve_process_group(group)
    return dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group


def op_bytes(op: str, args) -> tuple[str, int, int]:
    """(kind, bytes sent by this rank, payload bytes) of one c10d / functional collective op."""
    if op == "c10d::alltoall_base_":
        out, inp, pg, _, in_splits = args[:5]
        n, me = _group(pg).size(), _group(pg).rank()
        rows = list(in_splits) or [inp.shape[0] // n] * n
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        return "all-to-all", (sum(rows) - rows[me]) * row, inp.nbytes
    if op == "_c10d_functional::all_to_all_single":
        inp, _, in_splits, group = args[:4]
        n = _group(group).size()
        return "all-to-all", inp.nbytes * (n - 1) // n, inp.nbytes
    if op == "c10d::_allgather_base_":
        out, inp, pg = args[:3]
        return "all-gather", (_group(pg).size() - 1) * inp.nbytes, out.nbytes
    if op == "_c10d_functional::all_gather_into_tensor":
        inp, n = args[0], args[1]
        return "all-gather", (n - 1) * inp.nbytes, n * inp.nbytes
    if op == "_c10d_functional::reduce_scatter_tensor":
        inp, n = args[0], args[2]
        return "reduce-scatter", inp.nbytes * (n - 1) // n, inp.nbytes
    if op == "c10d::allreduce_":
        payload, n = sum(t.nbytes for t in args[0]), _group(args[1]).size()
        return "all-reduce", 2 * (n - 1) * payload // n, payload
    if op == "_c10d_functional::all_reduce":
        payload, n = args[0].nbytes, _group(args[2]).size()
        return "all-reduce", 2 * (n - 1) * payload // n, payload
    if op == "c10d::send":
        payload = sum(t.nbytes for t in args[0])
        return "send", payload, payload
    if op == "c10d::recv_":
        return "recv", 0, 0
    return f"other: {op}", 0, 0


_NOT_COLLECTIVES = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")


class OpCommCounter(TorchDispatchMode):
    """Bytes of every c10d / functional collective op this rank issues, per kind."""

    def __init__(self):
        super().__init__()
        self.totals = collections.defaultdict(lambda: [0, 0, 0])  # kind -> [sent, payload, calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func._schema.name not in _NOT_COLLECTIVES:
            kind, sent, payload = op_bytes(func._schema.name, args)
            t = self.totals[kind]
            t[0] += sent
            t[1] += payload
            t[2] += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# saved for backward


class ModuleTags:
    """Which module is running (innermost), through global module hooks."""

    def __init__(self, model):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack = []

    def __enter__(self):
        from torch.nn.modules import module as mm

        def pre(module, args):
            self.stack.append(self.names.get(id(module), "?"))

        def post(module, args, out):
            if self.stack:
                self.stack.pop()

        self.handles = [mm.register_module_forward_pre_hook(pre), mm.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


def saved_storages(model, batch) -> dict:
    """{storage address: (module, local shape, dtype, storage bytes)} saved in one training forward;
    each storage once, parameter and buffer storages excluded, DTensors by their local tensor."""
    weights = {_local(t).untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    seen = {}
    tags = ModuleTags(model)

    def pack(t):
        local = _local(t)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        ptr = storage.data_ptr()
        if ptr and ptr not in weights and ptr not in seen:
            seen[ptr] = (tags.current, tuple(local.shape), str(local.dtype).replace("torch.", ""), storage.nbytes())
        return t

    with tags, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)  # the graph keeps every saved storage alive while `out` lives
    del out
    return seen
