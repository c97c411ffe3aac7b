"""The sweep's results: zoo.json (every row) and zoo.md (the counts by status x variant x layout, the
causes of the refusals, every row)."""

from __future__ import annotations

import json
from pathlib import Path

ERRORS = ("loss_err", "grad_err", "logits_err", "tokens_err", "scores_err")
STATUSES = ("EXACT", "REFUSED", "WRONG", "CRASHED", "HUNG", "NOT-RUNNABLE", "UNBUILDABLE", "NOT-A-TEXT-LM")
ORDER = {"padded": 0, "packed": 1, "generate": 2, "images": 3, "images-generate": 4}
ORDER.update({"ulysses": 0, "ring": 1, "tp2": 2, "hybrid": 3})


def short(row: dict) -> str:
    if row["status"] in ("EXACT", "WRONG"):
        errs = " ".join(f"{k[:-4]}={row[k]:.1e}" for k in ERRORS if k in row)
        return errs + (f" | {row['reason']}" if row.get("reason") else "")
    return (row.get("reason", "") + (f" @ {row['where']}" if row.get("where") else ""))[:300]


def counts_table(rows: list[dict]) -> list[str]:
    """Markdown: one line per variant x layout (and a total per variant), a column per status."""
    cells: dict = {}
    for r in rows:
        for key in ((r["variant"], r["layout"]), (r["variant"], "all")):
            cells.setdefault(key, {}).setdefault(r["status"], 0)
            cells[key][r["status"]] += 1
    present = [s for s in STATUSES if any(s in c for c in cells.values())]
    present += sorted({s for c in cells.values() for s in c} - set(present))
    lines = ["| variant | layout | rows | " + " | ".join(present) + " |", "|---|---|---|" + "---|" * len(present)]
    keys = sorted(cells, key=lambda k: (ORDER.get(k[0], 9), k[1] == "all", ORDER.get(k[1], 9)))
    for variant, layout in keys:
        c = cells[(variant, layout)]
        name = f"**{layout}**" if layout == "all" else layout
        lines.append(
            f"| {variant} | {name} | {sum(c.values())} | " + " | ".join(str(c.get(s, 0)) for s in present) + " |"
        )
    return lines


def write(rows: list[dict], out: Path, wall: float, command: str) -> None:
    import transformers

    from .causes import cause

    out.mkdir(parents=True, exist_ok=True)
    meta = {"transformers": transformers.__version__, "wall_seconds": round(wall, 1), "command": command}
    (out / "zoo.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    classes = {(r["model_type"], r["class"]) for r in rows}
    totals: dict = {}
    for r in rows:
        totals[r["status"]] = totals.get(r["status"], 0) + 1
    lines = [
        f"# seqpar_hf conformance sweep (transformers {transformers.__version__})",
        "",
        f"`{command}`: {len(classes)} mapping entries, {len(rows)} rows (entry x layout x variant), "
        f"wall time {wall / 60:.1f} min. "
        + ", ".join(f"{n} {s}" for s, n in sorted(totals.items(), key=lambda kv: -kv[1]))
        + ".",
        "",
        "Generate rows: only where the padded row of the same class and layout is EXACT (images-generate: the "
        "images row). Images rows: the image-text-to-text mapping, with a two-block vision tower and synthetic "
        "images (conformance/images.py).",
        "",
    ]
    lines += counts_table(rows)
    causes: dict = {}
    for r in rows:
        if r["status"] == "REFUSED":
            causes.setdefault(cause(r.get("reason", "")), set()).add(r["class"])
    lines += ["", "| REFUSED because | classes |", "|---|---|"]
    lines += [f"| {c} | {len(n)} |" for c, n in sorted(causes.items(), key=lambda kv: -len(kv[1]))]
    for variant in ("padded", "packed", "generate", "images", "images-generate"):
        exact = {r["class"] for r in rows if r["status"] == "EXACT" and r["variant"] == variant}
        lines.append(f"\nClasses EXACT in at least one layout, {variant}: {len(exact)}.")
    unclear = sum(r.get("refusal") == "unclear" for r in rows)
    lines += [
        "",
        f"REFUSED rows whose error does not say why (not a ValueError / NotImplementedError naming the "
        f'structure, or "found no attention modules"): {unclear}, marked REFUSED? below.',
    ]
    lines += [
        "",
        "Root causes of every WRONG / CRASHED / HUNG / unclear REFUSED row: diagnosis.md.",
        "",
        "| class | model_type | layout | variant | status | tiny shape | reason / worst error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        detail = short(r).replace("|", "\\|").replace("\n", " ")
        status = r["status"] + ("?" if r.get("refusal") == "unclear" else "")
        lines.append(
            f"| {r['class']} | {r['model_type']} | {r['layout']} | {r['variant']} | {status} | "
            f"{r.get('shape', '')} | {detail} |"
        )
    (out / "zoo.md").write_text("\n".join(lines) + "\n")
