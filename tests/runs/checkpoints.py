"""In-rank bodies (misc group, 2 ranks) of the Trainer's bad-input cases: failed saves, checkpoints missing
weights, truncated or written at a layout they cannot resume at, an unwritable output_dir, ranks asking for
different layouts. Asserted in tests/test_robustness_gloo.py."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from .robustness import attempt, per_rank
from .trainer import make_trainer

PATHS = {"plain": dict(sp=2), "tp": dict(sp=1, tp=2), "fsdp": dict(sp=2, extra={"fsdp": "full_shard"})}
NO_SPACE = OSError(28, "No space left on device")


@contextlib.contextmanager
def failing_torch_save(when=lambda: True):
    """torch.save raises "No space left on device" on rank 0 while `when()` holds (the optimizer, the
    rng state and the training arguments are written with it)."""
    original = torch.save

    def save(*args, **kwargs):
        if dist.get_rank() == 0 and when():
            raise NO_SPACE
        return original(*args, **kwargs)

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


def _shared_dir() -> str:
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def _trainer(path: str, output_dir: str, steps: int = 2):
    config = dict(PATHS[path])
    extra = {"save_strategy": "steps", "save_steps": 1, "eval_strategy": "no", **config.pop("extra", {})}
    return make_trainer(steps=steps, output_dir=output_dir, extra=extra, **config)[0]


def _edit_weights(checkpoint: str, drop: str | None = None, add: str | None = None) -> None:
    if dist.get_rank() == 0:
        path = os.path.join(checkpoint, "model.safetensors")
        weights = load_file(path)
        if drop:
            weights.pop(drop)
        if add:
            weights[add] = torch.zeros(2)
        save_file(weights, path, metadata={"format": "pt"})
    dist.barrier()


def _damage(path: str, remove: bool = False) -> None:
    """Rank 0 removes the file or cuts it in half (a save that was interrupted)."""
    if dist.get_rank() == 0:
        if remove:
            os.remove(path)
        else:
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
    dist.barrier()


def _listing(folder: str) -> str:
    return str(sorted(os.listdir(folder))) if os.path.isdir(folder) else "missing"


def cases(results: dict) -> None:
    base, resumed_at = _shared_dir(), {}
    for path in PATHS:
        out = os.path.join(base, path)
        trainer = _trainer(path, out)
        with failing_torch_save(when=lambda: trainer.state.global_step == 2):
            results[f"save-fails-{path}"] = attempt(trainer.train)  # checkpoint-1 written, checkpoint-2 fails
        results[f"save-fails-{path}-listing"] = (_listing(out), 0.0)
        _edit_weights(os.path.join(out, "checkpoint-1"), drop="model.decoder.layers.0.encoder_attn.out_proj.bias")
        resumed = resumed_at[path] = _trainer(path, out + "-resumed")
        results[f"resume-missing-weight-{path}"] = attempt(
            lambda: resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
        )
        if path == "plain":
            _edit_weights(os.path.join(out, "checkpoint-1"), add="model.no_such.weight")
            results["resume-unexpected-weight-plain"] = attempt(
                lambda: resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
            )
            with failing_torch_save():
                results["save-model-fails"] = attempt(lambda: resumed.save_model(out + "-final"))
    # resuming at tp 2 a checkpoint written at tp 1 that does not record its optimizer's parameter names (written
    # before they were recorded); a truncated file: refused on every rank before the resume's first collective
    plain, tp = os.path.join(base, "plain", "checkpoint-1"), os.path.join(base, "tp", "checkpoint-1")
    _damage(os.path.join(plain, "seqpar_layout.json"), remove=True)
    results["resume-numbered-optimizer-at-tp"] = attempt(lambda: resumed_at["tp"].train(resume_from_checkpoint=plain))
    _damage(os.path.join(tp, "model.safetensors"))
    results["resume-truncated-weights-tp"] = attempt(lambda: resumed_at["tp"].train(resume_from_checkpoint=tp))
    a_file = os.path.join(base, "a-file")
    if dist.get_rank() == 0:
        open(a_file, "w").close()
    results["output-dir-unwritable"] = attempt(lambda: make_trainer(sp=2, output_dir=os.path.join(a_file, "out")))
    results["trainer-sp-sizes-differ"] = attempt(
        lambda: make_trainer(sp=per_rank((2, 1)), output_dir=os.path.join(base, "sp"))
    )
