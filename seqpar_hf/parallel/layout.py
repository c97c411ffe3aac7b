"""Where every rank sits: one validated object built once and passed down.

Vocabulary used across the package:
- *rank*: a process of the default process group; *world*: all of them.
- *TP group*: `tp_size` consecutive ranks that split attention heads and MLP columns (Megatron-style
  tensor parallelism, with the norm regions sharded along the sequence).
- *SP group*: `sp_size` ranks with the same TP index that share one batch and split its sequences.
  Inside it, sp = ulysses_size x ring_size: *Ulysses groups* exchange heads by all-to-all, *ring
  groups* pass K/V blocks by send/recv.
- *replica*: the sp x tp ranks that hold one copy of the model and read one batch; *DP group*: the
  ranks at the same place in different replicas (gradients average over them).

The ranks form a `DeviceMesh` of shape (dp, ring, ulysses, tp), TP innermost (the fastest links),
with the flattened dims "sp" = (ring, ulysses), "replica" = (ring, ulysses, tp): the ranks that read one
batch, and "dp_sp" = (dp, ring, ulysses): the ranks that hold identical weights, over which FSDP shards.
World = dp x sp x tp.

Every rank must build the same layouts in the same order: building one is collective (the mesh creates
process groups on every rank), and ranks that ask for different meshes would wait in different
collectives forever. So before the mesh the ranks compare what they were asked for, in one small
all-gather over the default group, and all raise the same error, naming the field and every rank's value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from .. import _compat
from .agree import agreement_device, same_on_every_rank

MODES = ("ulysses", "ring", "hybrid", "auto")  # auto: chosen at patch_model (parallel/auto.py)
MESH_DIMS = ("dp", "ring", "ulysses", "tp")
# Layouts this process built per default process group (keyed by its id): a layout's `serial`, which the
# forward's fingerprint compares, so that ranks whose models were patched with different layout objects of
# the same sizes (their groups may be the same, e.g. the whole world) raise rather than mix them.
_BUILT: dict[int, int] = {}


@dataclass(frozen=True)
class LayoutSizes:
    """The validated sizes of a layout; pure arithmetic, no process group needed."""

    world_size: int
    sp_size: int
    mode: str
    ring_size: int | None  # None: mode "auto", not chosen yet
    ulysses_size: int | None
    dp_size: int
    tp_size: int = 1


def check_head_chunks(value) -> int | str:
    """The one check of a `head_chunks` setting (the layout's and `--sp_head_chunks`); returns it."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"head_chunks={value!r} (--sp_head_chunks): use 'auto' or a positive integer, the most parts "
        "a Ulysses exchange is split into to overlap with the attention kernel"
    )


MIXER_SPLITS = ("auto", "heads")


def check_mixer_split(value) -> str:
    """The one check of a `mixer_split` setting (the layout's and `--sp_mixer_split`); returns it."""
    if value in MIXER_SPLITS:
        return value
    raise ValueError(
        f"mixer_split={value!r} (--sp_mixer_split): use 'auto' (token mixers split along the sequence where "
        "proven, else by heads) or 'heads' (by heads where proven, else along the sequence)"
    )


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def validate_sizes(
    world_size: int, sp_size: int, mode: str = "ulysses", ring_size: int | None = None, tp_size: int = 1
) -> LayoutSizes:
    """Check the sizes before any collective; every error names the value and the fix."""
    if mode not in MODES:
        raise ValueError(f"unknown sequence-parallel mode {mode!r}; choose one of {', '.join(MODES)}")
    _positive("sp_size", sp_size)
    _positive("tp_size", tp_size)
    replica = sp_size * tp_size
    if world_size % replica:
        what = f"sp_size={sp_size}" if tp_size == 1 else f"sp_size x tp_size = {sp_size} x {tp_size} = {replica}"
        raise ValueError(
            f"world size {world_size} is not divisible by {what}; launch a multiple of {replica} processes or "
            f"pick sizes whose product divides {world_size}"
        )
    if mode == "auto":
        if ring_size is not None:
            raise ValueError(
                f"mode='auto' chooses the ring size itself (got ring_size={ring_size}); use mode='hybrid' to set it"
            )
        return LayoutSizes(world_size, sp_size, mode, None, None, world_size // replica, tp_size)
    if mode == "ulysses":
        if ring_size not in (None, 1):
            raise ValueError(
                f"mode='ulysses' takes no ring_size (got {ring_size}); use mode='hybrid' for ulysses x ring"
            )
        ring_size = 1
    elif mode == "ring":
        if ring_size not in (None, sp_size):
            raise ValueError(
                f"mode='ring' uses ring_size=sp_size={sp_size} (got ring_size={ring_size}); "
                "use mode='hybrid' to mix Ulysses and ring"
            )
        ring_size = sp_size
    else:  # hybrid
        if ring_size is None:
            raise ValueError(f"mode='hybrid' needs ring_size, a divisor of sp_size={sp_size} (e.g. ring_size=2)")
        if not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
            raise ValueError(
                f"ring_size={ring_size} does not divide sp_size={sp_size}; "
                f"pick one of {[d for d in range(1, sp_size + 1) if sp_size % d == 0]}"
            )
    return LayoutSizes(world_size, sp_size, mode, ring_size, sp_size // ring_size, world_size // replica, tp_size)


def _device_type() -> str:
    # nccl: CUDA; gloo: CPU (a layout given `device_type` uses that)
    return "cuda" if "nccl" in dist.get_backend() else "cpu"


@dataclass(eq=False)
class ParallelLayout:
    """DP x SP (x TP) layout over the default process group, on a named `DeviceMesh`.

    >>> dist.init_process_group("gloo")                # or nccl
    >>> layout = ParallelLayout(sp_size=2, mode="ulysses")
    >>> layout.sp_rank, layout.dp_rank, layout.dp_size, layout.submesh("sp")

    `sp_size=1, tp_size=1` is valid without a process group: every model forward then runs as if
    unpatched. `mode="hybrid"` runs Ulysses inside groups of `sp_size // ring_size` ranks and a ring
    across them. Every rank must build the layout (creating groups is collective), in the same order;
    ranks that ask for different layouts all raise a ValueError naming the field and every rank's value.
    `timeout`: how long a collective of the layout's groups waits for the other ranks (None: the default
    process group's timeout; torch would give the mesh's groups 30 minutes on gloo). `device_type`: the
    mesh's device type, "cuda" or "cpu" (None: "cuda" on NCCL, else "cpu"), for a process group whose
    backend does not say (one that runs on both).
    A layout is shared, never copied: `copy.deepcopy` returns the same object (a deep-copied model
    keeps its process groups), and never changed once built. `mode="auto"` builds no groups: `patch_model`
    chooses for each model from its heads (`seqpar_hf.parallel.auto`) and patches it with a new, resolved
    layout (`seqpar_hf.layout_of(model)`); the auto layout itself stays as built, so it can patch several
    models. `head_chunks`: parts of a Ulysses exchange overlapped with the kernel ("auto": by the
    exchange's size; an int: at most that many). `mixer_split`: how token mixers outside attention (gated
    DeltaNets, Mamba) split where both ways are proven ("auto": along the sequence, by heads where a fused kernel
    hides the scan at run time; "heads": by heads; seqpar_hf/models/mixers/install.py).
    """

    sp_size: int = 1
    mode: str = "ulysses"
    ring_size: int | None = None
    tp_size: int = 1
    head_chunks: int | str = "auto"
    mixer_split: str = "auto"
    timeout: timedelta | None = None
    device_type: str | None = None
    sizes: LayoutSizes = field(init=False, repr=False)
    auto_choice = None  # on a layout resolved from mode="auto": the `auto.Choice` it was built from, with its reason

    def __post_init__(self):
        check_head_chunks(self.head_chunks)
        check_mixer_split(self.mixer_split)
        if self.mode == "auto":
            running = dist.is_available() and dist.is_initialized()
            self.sizes = validate_sizes(
                dist.get_world_size() if running else 1, self.sp_size, self.mode, self.ring_size, self.tp_size
            )
            if self.sp_size > 1:  # dp / world sizes are known; groups belong to the layouts `resolved` returns
                self.rank = dist.get_rank() if running else 0
                self.device_type = self.device_type or (_device_type() if running else "cpu")
                self._resolved = {}  # (mode, ring_size) -> the layout built for it: models that agree share one
                if running:
                    self._agree(self.ring_size)  # every rank asked for "auto" (resolved together later)
                self._sealed = True
                return
            self.mode = "ulysses"
        self._build()
        self._sealed = True

    def __setattr__(self, name, value):
        # the model patched with a layout, its process groups and its forward's fingerprint all read these values
        if self.__dict__.get("_sealed"):
            raise AttributeError(
                f"ParallelLayout.{name} cannot be changed once the layout is built; build another ParallelLayout"
            )
        super().__setattr__(name, value)

    def resolved(self, choice) -> ParallelLayout:
        """The layout `mode="auto"` chose (`choice`: mode, ring size and reason, `seqpar_hf.parallel.auto`): a new
        layout with that mode and groups; this one is left as built. Collective the first time for each choice
        (it builds the groups): every rank, same choice."""
        if self.mode != "auto":
            raise ValueError(f"{self} is not mode='auto': there is nothing to resolve")
        key = (choice.mode, choice.ring_size)
        if key not in self._resolved:
            layout = dataclasses.replace(self, mode=choice.mode, ring_size=choice.ring_size)
            object.__setattr__(layout, "auto_choice", choice)  # still being built: nobody else holds it yet
            self._resolved[key] = layout
        return self._resolved[key]

    def __getattr__(self, name):  # only reached for attributes not set: an auto layout (never resolved itself)
        if name.startswith("_") or self.__dict__.get("mode") != "auto":
            raise AttributeError(name)
        # an AttributeError, so that hasattr / getattr with a default still work
        raise AttributeError(
            f"ParallelLayout(mode='auto').{name}: an auto layout has no groups of its own; "
            "seqpar_hf.patch_model(model, layout) chooses a layout for each model from its heads: "
            "read it with seqpar_hf.layout_of(model)"
        )

    def _build(self):
        if not (dist.is_available() and dist.is_initialized()):
            if self.sp_size == 1 and self.tp_size == 1:  # a no-op layout needs no process group
                self.sizes = validate_sizes(1, 1, self.mode, self.ring_size)
                self.ring_size = self.sizes.ring_size
                self.rank, self.mesh, self.device_type, self.serial = 0, None, self.device_type or "cpu", 0
                self.sp_group = self.dp_group = self.ulysses_group = self.ring_group = None
                self.tp_group = self.dp_sp_group = self.replica_group = None
                self.sp_ranks = self.ulysses_ranks = self.ring_ranks = self.tp_ranks = self.replica_ranks = (0,)
                return
            raise RuntimeError(
                f"ParallelLayout(sp_size={self.sp_size}, tp_size={self.tp_size}) needs a process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (accelerate launch / torchrun do)"
            )
        self.rank, self.serial = dist.get_rank(), 0
        self.device_type = self.device_type or _device_type()
        try:
            sizes, error = (
                validate_sizes(dist.get_world_size(), self.sp_size, self.mode, self.ring_size, self.tp_size),
                None,
            )
        except (ValueError, TypeError) as exc:
            sizes, error = None, exc
        # before raising: an error on some ranks only would leave the others waiting in the mesh
        self._agree(sizes.ring_size if sizes is not None else self.ring_size)
        if error is not None:
            raise error
        s = self.sizes = sizes
        self.ring_size = s.ring_size
        # init_device_mesh is collective; so is flattening (both create process groups on every rank).
        self.mesh = _compat.init_mesh(self.device_type, (s.dp_size, s.ring_size, s.ulysses_size, s.tp_size), MESH_DIMS)
        # the flattened dims are kept as flattening returns them: slicing one back out of the root mesh
        # (`mesh["sp"]`) is deprecated from torch 2.11, with a warning on every rank
        flat = {"sp": ("ring", "ulysses"), "dp_sp": ("dp", "ring", "ulysses")}
        if s.tp_size > 1:
            flat["replica"] = ("ring", "ulysses", "tp")
        self.flat_meshes = {name: _compat.flatten_mesh(self.mesh, dims, name) for name, dims in flat.items()}
        self.sp_group, self.sp_ranks = self._group("sp")
        self.ulysses_group, self.ulysses_ranks = self._group("ulysses")
        self.ring_group, self.ring_ranks = self._group("ring")
        self.dp_group, _ = self._group("dp")
        self.tp_group, self.tp_ranks = self._group("tp")
        self.dp_sp_group, _ = self._group("dp_sp")
        # the ranks that read one batch: the SP group, times TP when used (with tp_size 1, the SP group itself)
        self.replica_group, self.replica_ranks = (
            self._group("replica") if s.tp_size > 1 else (self.sp_group, self.sp_ranks)
        )
        self._set_timeouts()

    def _agree(self, ring_size) -> None:
        """Every rank asks for the same layout (so ranks building layouts in different orders fail at the
        first one that differs); else all raise. One all-gather of 8 x 48 bytes per rank."""
        world = id(dist.group.WORLD)
        self.serial = _BUILT.get(world, 0)
        _BUILT[world] = self.serial + 1
        asked = {
            "mode": self.mode,
            "sp_size": self.sp_size,
            "ring_size": ring_size,
            "tp_size": self.tp_size,
            "head_chunks": self.head_chunks,
            "mixer_split": self.mixer_split,
            "timeout": self.timeout,
            "device_type": self.device_type,
        }
        same_on_every_rank(
            asked,
            dist.group.WORLD,
            agreement_device(self.device_type),
            "the ParallelLayout they build",
            "Every rank must build the same ParallelLayout, in the same order (building one creates "
            "process groups on every rank): pass the same arguments on every rank.",
        )
        if self.timeout is not None and (not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0):
            raise ValueError(
                f"timeout={self.timeout!r}: pass a positive datetime.timedelta (or None: the default "
                "process group's timeout)"
            )
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(
                f"device_type={self.device_type!r}: pass 'cpu' or 'cuda' (or None: from the process group's backend)"
            )

    def _set_timeouts(self) -> None:
        """The mesh's groups get torch's default timeout (30 min on gloo), not the default group's. A dim
        that spans the whole world is the default group itself: it keeps its own timeout."""
        timeout = self.timeout if self.timeout is not None else _compat.group_timeout(None)
        groups = (
            self.sp_group,
            self.ulysses_group,
            self.ring_group,
            self.dp_group,
            self.tp_group,
            self.dp_sp_group,
            self.replica_group,
        )
        for group in {id(g): g for g in groups if g is not None and g is not dist.group.WORLD}.values():
            if timeout is not None:
                group.set_timeout(timeout)

    def submesh(self, name: str):
        """The 1-D mesh of one named dim: "dp", "ring", "ulysses", "tp", or a flattened one ("sp", "dp_sp",
        "replica" with TP); what FSDP2 and DTensor take."""
        return self.flat_meshes[name] if name in self.flat_meshes else self.mesh[name]

    def _group(self, name: str):
        sub = self.submesh(name)
        ranks = tuple(int(r) for r in sub.mesh.flatten().tolist())  # global ranks, in the dim's order
        return (None if len(ranks) == 1 else sub.get_group()), ranks

    def __deepcopy__(self, memo):
        return self  # process groups cannot be copied, and a copied model belongs to the same layout

    def __reduce__(self):
        raise TypeError("a ParallelLayout holds process groups and cannot be pickled; build one per process")

    # sizes and coordinates ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    @property
    def dp_size(self) -> int:
        return self.sizes.dp_size

    @property
    def ulysses_size(self) -> int | None:  # None: an auto layout (not resolved)
        return self.sizes.ulysses_size

    @property
    def sp_rank(self) -> int:
        return self.sp_ranks.index(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.sizes.sp_size * self.sizes.tp_size)

    @property
    def ulysses_rank(self) -> int:
        return self.ulysses_ranks.index(self.rank)

    @property
    def ring_rank(self) -> int:
        return self.ring_ranks.index(self.rank)

    @property
    def replica_size(self) -> int:
        """Ranks that read one batch together: sp x tp."""
        return self.sizes.sp_size * self.sizes.tp_size

    @property
    def enabled(self) -> bool:
        """False for sp_size=1: the patched model then runs the unsharded sequence on every rank."""
        return self.sizes.sp_size > 1

    def __repr__(self) -> str:
        if self.mode == "auto":
            return f"ParallelLayout(mode='auto', sp_size={self.sp_size}, tp_size={self.tp_size}, chosen per model)"
        s = self.sizes
        tp = f", tp_size={s.tp_size}" if s.tp_size > 1 else ""
        auto = ", chosen by mode='auto'" if self.auto_choice is not None else ""
        return (
            f"ParallelLayout(mode={s.mode!r}, sp_size={s.sp_size}, ring_size={s.ring_size}, "
            f"ulysses_size={s.ulysses_size}{tp}, dp_size={s.dp_size}, rank={self.rank}, "
            f"sp_rank={self.sp_rank}, dp_rank={self.dp_rank}{auto})"
        )
