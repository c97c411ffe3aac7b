"""What a run says when sequence (or tensor) parallelism is on: one INFO line when a model is patched (the
layout, the mode and, when mode="auto" chose it, why) and one at its first sharded forward (the padding and
the tokens per rank). Logger "seqpar_hf", on global rank 0 only (every rank holds the same layout).

As transformers does for its own logger, a Trainer run shows them on its main process (`show_in_runs`);
elsewhere the application's logging decides (e.g. `logging.basicConfig(level=logging.INFO)`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("seqpar_hf")


def show_in_runs(main_process: bool) -> None:
    """INFO on the main process and WARNING on the others, unless the application set the "seqpar_hf" level
    itself; a stderr handler when no handler would print the lines at all."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if main_process else logging.WARNING)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)


def layout_applied(layout, model) -> None:
    """Called at the end of `patch_model` with the layout the model runs on (resolved, if it was "auto")."""
    s = layout.sizes
    if s.sp_size * s.tp_size == 1 or layout.rank != 0:
        return
    choice = getattr(layout, "auto_choice", None)
    why = f", chosen by mode='auto' ({choice.reason})" if choice is not None else ""
    logger.info(
        "%s is sequence-parallel: sp=%d (ulysses %d x ring %d), tp=%d, dp=%d, over %d ranks; mode %s%s",
        type(model).__name__,
        s.sp_size,
        s.ulysses_size,
        s.ring_size,
        s.tp_size,
        s.dp_size,
        s.world_size,
        s.mode,
        why,
    )


def mixers(layout, backbone, chosen: dict) -> None:
    """How the token mixers outside attention run (models/mixers/): split along the sequence, by heads, or whole
    and why."""
    if not chosen or layout.rank != 0:
        return
    kinds: dict = {}
    for name, how in chosen.items():
        kinds.setdefault((type(backbone.get_submodule(name)).__name__, how), []).append(name)
    for (kind, how), names in sorted(kinds.items()):
        if how == "sequence":
            logger.info(
                "%d %s layers split along the sequence over the %d ranks of the SP group (a convolution given the "
                "previous tokens' inputs, a scan started from their state; mixer_split='heads' splits by heads "
                "where that is proven)",
                len(names),
                kind,
                layout.sp_size,
            )
        elif how == "heads":
            asked = getattr(layout, "mixer_split", "auto") == "heads"
            logger.info(
                "%d %s layers split by heads over the %d ranks of the SP group (%s)",
                len(names),
                kind,
                layout.sp_size,
                "mixer_split='heads'" if asked else "not proven along the sequence",
            )
        else:
            logger.info(
                "%d %s layers run on the whole sequence on every rank (activations not divided by sp): it %s",
                len(names),
                kind,
                how,
            )


def first_forward(layout, plans: dict) -> None:
    """`plans`: side ("encoder", "decoder") -> the `ShardPlan` of the model's first sharded forward."""
    if layout.sizes.sp_size * layout.sizes.tp_size == 1 or layout.rank != 0:
        return
    sides = "; ".join(
        f"{side} {plan.length} tokens padded to {plan.padded}, {plan.local_length} per rank"
        for side, plan in plans.items()
    )
    logger.info("first forward: %s (sp=%d; logged once, later batches differ)", sides, layout.sizes.sp_size)
