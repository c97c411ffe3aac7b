"""What the patch-time dry run (seqpar_hf/models/proof/probe.py) costs, and whether it raises false alarms in
half precision, over every class of the zoo (conformance/tiny.py), in one process.

    python -m benchmarks.dry_run_cost                 # -> benchmarks/results/dry_run_cost.json
    python -m benchmarks.dry_run_cost --classes llama opt

Per class: milliseconds of `inspect_model` without a sequence split (the full run: backbone, attention
calls, head; what `sp_size=1` pays) and with one (plus the shard runs, eval and training mode: what
`patch_model` pays for sp > 1 or tp > 1), medians of 3 after a warm-up, 1 thread. Then the same model
in bfloat16: a class accepted in float32 but refused in bfloat16 would be a false alarm of the
rounding tolerance (probe_checks.tolerance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out) * 1000


def measure(classes=None) -> dict:
    import torch

    from conformance.tiny import Unbuildable, build_tiny, mapping_classes
    from seqpar_hf.models.proof.inspection import inspect_model

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows, seen = {}, set()
    for model_type, class_name, _ in mapping_classes():
        if (model_type, class_name) in seen or (classes and model_type not in classes and class_name not in classes):
            continue
        seen.add((model_type, class_name))
        try:
            model, _ = build_tiny(model_type, class_name)
        except (Unbuildable, Exception):  # noqa: BLE001 - not in the zoo's runnable part
            continue
        row = {"params": sum(p.numel() for p in model.parameters())}
        try:
            inspect_model(model, split=True)
            row["accepted"] = True
            row["ms_no_split"] = round(_time(lambda: inspect_model(model, split=False)), 1)
            row["ms_split"] = round(_time(lambda: inspect_model(model, split=True)), 1)
        except Exception as exc:  # noqa: BLE001 - a refusal (ValueError) or a failure: recorded either way
            row["accepted"], row["refusal"] = False, str(exc)[:200]
        if row["accepted"]:
            try:
                inspect_model(model.to(torch.bfloat16), split=True)
                row["bf16"] = "accepted"
            except Exception as exc:  # noqa: BLE001 - likewise, in bf16
                row["bf16"] = f"refused: {str(exc)[:200]}"
        rows[f"{model_type}|{class_name}"] = row
        print(
            model_type,
            row.get("ms_no_split"),
            row.get("ms_split"),
            row.get("bf16", row.get("refusal", ""))[:100],
            flush=True,
        )
    accepted = [r for r in rows.values() if r["accepted"]]
    summary = {
        "classes": len(rows),
        "accepted": len(accepted),
        "median_ms_no_split": statistics.median(r["ms_no_split"] for r in accepted),
        "median_ms_split": statistics.median(r["ms_split"] for r in accepted),
        "max_ms_split": max(r["ms_split"] for r in accepted),
        "bf16_false_alarms": sorted(k for k, r in rows.items() if r.get("bf16", "accepted") != "accepted"),
    }
    return {"summary": summary, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", nargs="*")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dry_run_cost.json")
    args = parser.parse_args(argv)
    result = measure(args.classes)
    print(json.dumps(result["summary"], indent=1))
    if not args.classes:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
