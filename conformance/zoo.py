"""Conformance sweep: every class of transformers' causal-LM and seq2seq-LM auto mappings, tiny (with
the released checkpoints' shape ratios, tiny.py / released.py), x layout x variant, against the
unpatched model. Layouts: sp=2 Ulysses and ring, tp=2 (where the config has a tensor-parallel plan, or
is an encoder-decoder), in 2 gloo processes; sp=4 hybrid (Ulysses 2 x ring 2) in 4. Variants
(variants.py): padded, packed, generate (only where the padded row of the same layout is EXACT); the
image-text-to-text mapping's classes: images, images-generate (images.py; Ulysses, ring, hybrid).

    python -m conformance.zoo                       # everything -> conformance/results/zoo.{json,md}
    python -m conformance.zoo --sample              # the CI sample (conformance/sample.py)
    python -m conformance.zoo --classes llama lfm2 MarianMTModel --layouts ulysses hybrid \
        --variants padded generate --out /tmp/zoo

The worker processes of a group are spawned once and loop over the cases; the parent hands out one case
at a time (so a rank stuck in a collective can never meet the next case's collectives) and combines
the ranks' records. A rank that does not report within HANG_SECONDS of the others (gloo's own
timeout is GLOO_TIMEOUT) is HUNG; a rank that dies is CRASHED; after either, or after any record in
which something raised after patch_model, the group is killed and a fresh one continues with the
next case.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from .report import short, write

GLOO_TIMEOUT = 60  # seconds a collective waits for its peer
HANG_SECONDS = GLOO_TIMEOUT + 30  # after one rank reported
CASE_SECONDS = 300  # for a whole case (build, reference, patched, eval)
PING_SECONDS = 15
LAYOUTS = ("ulysses", "ring", "tp2", "hybrid")
WORLD = {"hybrid": 4}  # processes a layout needs; 2 for the others
VARIANTS = ("padded", "packed", "generate", "images", "images-generate")
TEXT_VARIANTS = ("padded", "packed", "generate")  # the text mappings' rows
IMAGE_VARIANTS = ("images", "images-generate")  # the image-text-to-text mapping's rows (images.py)
IMAGE_LAYOUTS = ("ulysses", "ring", "hybrid")
ERROR_KEYS = ("loss_err", "grad_err", "logits_err", "tokens_err", "scores_err")
RESULTS = Path(__file__).parent / "results"
CLEAN = ("EXACT", "WRONG", "REFUSED", "NOT-RUNNABLE", "UNBUILDABLE", "NOT-A-TEXT-LM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, inbox, outbox) -> None:
    """Loop: wait for the parent's go (a task index), run that case, report."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        TRANSFORMERS_VERBOSITY="error",
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GLOO_TIMEOUT))
        import seqpar_hf

        from .case import run_case

        if world == 4:
            layouts = {"hybrid": seqpar_hf.ParallelLayout(sp_size=4, mode="hybrid", ring_size=2)}
        else:
            layouts = {
                "ulysses": seqpar_hf.ParallelLayout(sp_size=2, mode="ulysses"),
                "ring": seqpar_hf.ParallelLayout(sp_size=2, mode="ring"),
                "tp2": seqpar_hf.ParallelLayout(sp_size=1, tp_size=2),
            }
        outbox.put((rank, "ready", None))
        while True:
            index = inbox.get()
            if index is None:
                break
            if index == "ping":  # is the process group still in step after a crash on both ranks?
                ones = torch.ones(1)
                dist.all_reduce(ones)
                outbox.put((rank, "ping", {"ok": ones.item() == world}))
                continue
            model_type, class_name, layout, variant = tasks[index]
            outbox.put((rank, index, run_case(model_type, class_name, layout, variant, layouts)))
    except BaseException:  # noqa: BLE001
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Group:
    """`world` worker processes sharing one gloo process group."""

    def __init__(self, tasks, world: int = 2):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, tasks, self.inboxes[r], self.outbox), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        ready = self._collect("ready", CASE_SECONDS, CASE_SECONDS)
        if len(ready) < world:
            self.close()
            raise RuntimeError(f"worker group did not start: {ready}")

    def _collect(self, key, first_timeout: float, other_timeout: float) -> dict:
        """{rank: record} for message `key`; stops early on a dead rank or a timeout."""
        got, deadline = {}, time.time() + first_timeout
        while len(got) < len(self.procs):
            if time.time() > deadline:
                break
            try:
                rank, k, value = self.outbox.get(timeout=1.0)
            except queue_module.Empty:
                if any(not p.is_alive() for r, p in enumerate(self.procs) if r not in got):
                    time.sleep(1.0)  # let a dying rank's last message arrive
                    while True:
                        try:
                            rank, k, value = self.outbox.get_nowait()
                        except queue_module.Empty:
                            break
                        if k == key:
                            got[rank] = value
                    break
                continue
            if k == "error":
                got[rank] = {"status": "CRASHED", "reason": f"worker died: {value.strip().splitlines()[-1]}"}
                continue
            if k != key:
                continue
            got[rank] = value
            deadline = min(deadline, time.time() + other_timeout)
        return got

    def run(self, index: int) -> dict:
        for inbox in self.inboxes:
            inbox.put(index)
        return self._collect(index, CASE_SECONDS, HANG_SECONDS)

    def ping(self) -> bool:
        for inbox in self.inboxes:
            inbox.put("ping")
        got = self._collect("ping", PING_SECONDS, PING_SECONDS)
        return len(got) == len(self.procs) and all(v.get("ok") for v in got.values())

    def close(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)


def combine(task, records: dict, exitcodes: list) -> dict:
    """One row from the ranks' records."""
    model_type, class_name, layout, variant = task
    row = {"model_type": model_type, "class": class_name, "layout": layout, "variant": variant}
    ranks = range(len(exitcodes))
    if len(records) < len(exitcodes):
        missing = [r for r in ranks if r not in records]
        dead = [r for r in missing if exitcodes[r] is not None]
        seen = {r: f"{v.get('status')}: {v.get('reason', '')}" for r, v in records.items()}
        if dead:
            row.update(
                status="CRASHED",
                reason=f"rank {dead} died (exit code {[exitcodes[r] for r in dead]}); other ranks: {seen}",
            )
        else:
            row.update(
                status="HUNG",
                reason=f"rank {missing} did not report within {HANG_SECONDS}s of the others; other ranks: {seen}",
            )
        return row
    recs = [records[r] for r in ranks]
    a = recs[0]
    for key in ("attn", "params", "kind", "shape", "where", "refusal", "at", "float64"):
        if key in a:
            row[key] = a[key]
    # a gloo timeout on any rank: one rank never joined a collective another waited in
    timed_out = any("timed out" in str(r.get("reason", "")).lower() for r in recs)
    if any(r["status"] != a["status"] for r in recs) or (
        a["status"] in ("REFUSED", "CRASHED") and any(r.get("reason") != a.get("reason") for r in recs)
    ):
        row.update(
            status="HUNG" if timed_out else "CRASHED",
            reason="ranks disagree: "
            + " | ".join(f"rank {i} {r['status']}: {r.get('reason', '')}" for i, r in enumerate(recs)),
        )
        return row
    row.update(status="HUNG" if timed_out and a["status"] == "CRASHED" else a["status"], reason=a.get("reason", ""))
    for key in ERROR_KEYS:
        if key in a:
            row[key] = max(r[key] for r in recs)
    if "grad_err" in a:
        row["worst_param"] = max(recs, key=lambda r: r["grad_err"])["worst_param"]
    row["seconds"] = max(r.get("seconds", 0) for r in recs)
    return row


def plan_tasks(classes: list[tuple[str, str, str]], layouts=LAYOUTS, variants=VARIANTS) -> list[tuple]:
    """class x layout x variant; tp2 only where the config class has a tensor-parallel plan or is
    encoder-decoder; a class known not to build: one row, no layout or variant."""
    from .overrides import UNBUILDABLE
    from .tiny import base_type

    tasks = []
    for model_type, class_name, mapping in classes:
        if base_type(model_type) in UNBUILDABLE:
            tasks.append((model_type, class_name, "-", "-"))
            continue
        kinds = IMAGE_VARIANTS if mapping == "image" else TEXT_VARIANTS
        for layout in layouts:
            if layout == "tp2" and not _has_tp_plan(model_type, class_name):
                continue
            if mapping == "image" and layout not in IMAGE_LAYOUTS:
                continue
            tasks += [(model_type, class_name, layout, variant) for variant in kinds if variant in variants]
    return tasks


def _has_tp_plan(model_type: str, class_name: str) -> bool:
    import transformers
    from transformers import CONFIG_MAPPING

    from .tiny import base_type

    model_class = getattr(transformers, class_name, None)
    config_class = getattr(model_class, "config_class", None) or CONFIG_MAPPING[base_type(model_type)]
    try:
        config_class = config_class if isinstance(config_class, type) else CONFIG_MAPPING[base_type(model_type)]
        plan = getattr(config_class, "base_model_tp_plan", None)
        text = getattr(config_class, "sub_configs", None) or {}
        plan = plan or getattr(text.get("text_config"), "base_model_tp_plan", None)
        return bool(plan) or base_type(model_type) in _seq2seq_types()
    except Exception:  # noqa: BLE001
        return False


def _seq2seq_types() -> set:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def sweep(tasks: list, log=print, on_row=None) -> list[dict]:
    """The rows of `tasks`, in their order: those of 2-process layouts in one group, the hybrid's in a
    4-process one. A generate task runs only where the padded row of its class and layout (if planned)
    is EXACT."""
    rows, planned = {}, set(tasks)
    for world in sorted({WORLD.get(t[2], 2) for t in tasks}):
        group = None
        for i, task in enumerate(tasks):
            if WORLD.get(task[2], 2) != world:
                continue
            train = "images" if task[3] == "images-generate" else "padded"
            padded = rows.get(task[:3] + (train,))
            if (
                task[3] in ("generate", "images-generate")
                and task[:3] + (train,) in planned
                and (padded is None or padded["status"] != "EXACT")
            ):
                continue
            if group is None:
                group = Group(tasks, world)
            records = group.run(i)
            row = combine(task, records, [p.exitcode for p in group.procs])
            rows[task] = row
            log(
                f"[{i + 1}/{len(tasks)}] {task[0]:24s} {task[1]:40s} {task[2]:7s} {task[3]:8s} {row['status']:12s} "
                f"{short(row)}"
            )
            if on_row is not None:
                on_row(row)
            raised = row["status"] not in CLEAN or row.get("at") == "forward"  # raised after patch_model
            if raised and not (_symmetric(records, world) and group.ping()):
                group.close()
                group = None
        if group is not None:
            group.close()
    return [rows[t] for t in tasks if t in rows]


def _symmetric(records: dict, world: int) -> bool:
    """Every rank raised the same error at the same place: their collectives are still paired (checked
    by a ping), so the group can go on; anything else gets a fresh group."""
    recs = list(records.values())
    a = recs[0] if recs else {}
    return (
        len(recs) == world
        and all(
            r.get("status") == a.get("status")
            and r.get("reason") == a.get("reason")
            and r.get("where") == a.get("where")
            for r in recs
        )
        and "timed out" not in a.get("reason", "").lower()
    )


def zoo_tasks(names=None, layouts=LAYOUTS, variants=VARIANTS) -> list[tuple]:
    """class x layout x variant for every entry of both mappings (or those `names` name: model types, class
    names, variants "<model_type>:<name>"); a model type in both mappings with the same class is one entry."""
    from .tiny import base_type, mapping_classes

    classes = mapping_classes()
    if names:
        variants_ = [(v, cls, m) for v in names if ":" in v for mt, cls, m in classes if mt == base_type(v)]
        classes = [c for c in classes if c[0] in names or c[1] in names] + variants_
    seen, unique = set(), []
    for c in classes:  # a class in a text mapping and the image one gets both kinds of rows
        key = (c[0], c[1], "image" if c[2] == "image" else "text")
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return plan_tasks(unique, layouts, variants)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", nargs="*", help="model types or class names (default: all)")
    parser.add_argument("--sample", action="store_true", help="the fixed CI sample (conformance/sample.py)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.sample:
        from .sample import sample_tasks

        tasks = [t for t in sample_tasks() if t[2] in args.layouts + ["-"] and t[3] in args.variants + ["-"]]
    else:
        tasks = zoo_tasks(args.classes, args.layouts, args.variants)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = args.out / "zoo.progress.jsonl"  # one line per row as it comes (read it while a long sweep runs)
    progress.write_text("")

    def on_row(row):
        with progress.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    start = time.time()
    rows = sweep(tasks, log=lambda line: print(line, flush=True), on_row=on_row)
    command = "python -m conformance.zoo " + " ".join(argv if argv is not None else sys.argv[1:])
    write(rows, args.out, time.time() - start, command.strip())
    progress.unlink()
    print(f"wrote {args.out}/zoo.json and zoo.md ({len(rows)} rows, {time.time() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
