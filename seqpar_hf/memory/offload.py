"""Checkpointed layer inputs in host memory (ALST, Bekman et al. 2025, arXiv 2506.13996, section 3.3).

Under gradient checkpointing a layer keeps only its inputs for the backward (the rest is recomputed), and
under SP those are already this rank's 1/sp of the sequence: [b, s/sp, h] per layer, the largest activation
left at long lengths. transformers checkpoints a layer by calling its `_gradient_checkpointing_func`
(torch's `checkpoint`); the non-reentrant checkpoint saves the function's positional tensor arguments (the
hidden states; keyword arguments stay in the recompute closure) through whatever saved-tensors hooks are
active when it is called, and everything the layer itself saves through its own hooks (replaced by the
recompute). `OffloadCheckpoint` wraps that function per layer and calls it inside `LayerInputOffload`'s
hooks, so exactly the layer inputs pass through them: copied to host memory in the forward (pinned, on a
side stream, on CUDA) and copied back when the backward's recompute of the layer asks for them; the
previous layer's input is prefetched then, one layer ahead. A copy moves the bits unchanged, so the
gradients are bit-identical to no offload. On a CPU-only machine the same path copies host to host.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor


class _Record:
    """One offloaded layer input: the host copy, and the device copy prefetched for the backward."""

    def __init__(self, host: torch.Tensor, device: torch.device, dtensor, ready, prev: _Record | None):
        self.host, self.device, self.dtensor, self.ready = host, device, dtensor, ready
        # the input packed before this one in the same forward, unpacked next in the backward (weak: the autograd
        # graph owns the records, and frees each once its layer's backward is done)
        self.prev = weakref.ref(prev) if prev is not None else None
        self.prefetched: torch.Tensor | None = None
        self.loaded = None  # the event the current stream waits for before reading `prefetched`


class LayerInputOffload:
    """Saved-tensors hooks moving the tensors saved under them to host memory and back. `moved` counts the
    tensors and bytes offloaded, `restored` the tensors brought back (for tests and benchmarks)."""

    def __init__(self) -> None:
        self.moved, self.moved_bytes, self.restored = 0, 0, 0
        self.last: weakref.ref | None = None  # the record packed last in this forward
        self.streams: dict = {}  # device -> the side stream of its copies (CUDA)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def new_forward(self) -> None:
        self.last = None  # prefetching follows the packing order of one forward

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, t):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        local = t.to_local() if isinstance(t, DTensor) else t
        stream = self._stream(local.device)
        host = torch.empty_like(local, device="cpu", pin_memory=stream is not None)  # keeps the strides
        ready = None
        if stream is None:
            host.copy_(local)
        else:
            stream.wait_stream(torch.cuda.current_stream(local.device))  # the input is computed
            with torch.cuda.stream(stream):
                host.copy_(local, non_blocking=True)
            local.record_stream(stream)  # its memory is not reused before the copy ends
            ready = stream.record_event()
        self.moved += 1
        self.moved_bytes += local.numel() * local.element_size()
        record = _Record(host, local.device, dtensor, ready, self.last() if self.last is not None else None)
        self.last = weakref.ref(record)
        return record

    def _load(self, record: _Record) -> None:
        """Start copying `record` back to its device (on the side stream, on CUDA)."""
        if record.prefetched is not None:
            return
        stream = self._stream(record.device)
        if stream is None:
            record.prefetched = record.host.to(record.device, copy=True)
            return
        with torch.cuda.stream(stream):
            if record.ready is not None:
                stream.wait_event(record.ready)
            record.prefetched = record.host.to(record.device, non_blocking=True)
            record.loaded = stream.record_event()

    def unpack(self, record):
        if not isinstance(record, _Record):
            return record
        self._load(record)
        local, record.prefetched = record.prefetched, None  # a second backward (retain_graph) copies again
        assert local is not None
        if record.loaded is not None:
            current = torch.cuda.current_stream(record.device)
            current.wait_event(record.loaded)
            local.record_stream(current)  # allocated on the side stream, used on this one
            record.loaded = None
        prev = record.prev() if record.prev is not None else None
        if prev is not None:
            self._load(prev)  # the layer before: recomputed next, its input copied meanwhile
        self.restored += 1
        if record.dtensor is None:
            return local
        mesh, placements, shape, stride = record.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class OffloadCheckpoint:
    """A layer's `_gradient_checkpointing_func`, called inside the offload hooks (see the module docstring)."""

    def __init__(self, offload: LayerInputOffload, original):
        self.offload, self.original = offload, original

    def __call__(self, function, *args, **kwargs):
        with self.offload.hooks:
            return self.original(function, *args, **kwargs)


class OffloadLayers:
    """Forward pre-hook of the backbone: the checkpointed layers of `layers` call their checkpoint function
    through `OffloadCheckpoint` (installed at each forward: gradient checkpointing may be enabled, or
    re-enabled with other settings, after patching). A training forward with gradient checkpointing off
    has no layer inputs to offload: refused, naming the fix."""

    def __init__(self, offload: LayerInputOffload, layers: list, model_name: str):
        self.offload, self.layers, self.model_name = offload, layers, model_name
        # this forward's refusal, raised by the backbone's forward after the replica's ranks compared their
        # settings (raised here, before that collective, one rank alone would leave the others waiting in it)
        self.problem: str | None = None

    def checkpointed(self) -> int:
        """How many of the layers run under gradient checkpointing now (compared across the replica)."""
        return sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in self.layers)

    def __call__(self, module, args, kwargs):
        self.problem = None
        if not (module.training and torch.is_grad_enabled()):
            return None
        checkpointed = [layer for layer in self.layers if getattr(layer, "gradient_checkpointing", False)]
        if not checkpointed:
            self.problem = (
                f"offload_activations=True offloads the layer inputs that gradient checkpointing keeps, and "
                f"{self.model_name} trains without gradient checkpointing (no layer checkpointed): call "
                "model.gradient_checkpointing_enable() (Trainer: --gradient_checkpointing), or patch with "
                "offload_activations=False"
            )
            return None
        self.offload.new_forward()
        for layer in checkpointed:
            func = layer.__dict__.get("_gradient_checkpointing_func")
            if func is not None and not isinstance(func, OffloadCheckpoint):
                layer._gradient_checkpointing_func = OffloadCheckpoint(self.offload, func)
        return None

    def remove(self) -> None:
        """Give the layers their checkpoint functions back (unpatch_model)."""
        for layer in self.layers:
            func = layer.__dict__.get("_gradient_checkpointing_func")
            if isinstance(func, OffloadCheckpoint):
                layer._gradient_checkpointing_func = func.original
