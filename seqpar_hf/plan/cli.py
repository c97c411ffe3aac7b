"""`python -m seqpar_hf.plan`: arguments, their checks (argparse's error and exit code 2, naming the flag,
the value and what is allowed), the table of layouts and the recommendation."""

from __future__ import annotations

import argparse
from dataclasses import replace

from . import checks, howto, offload
from .checks import GIB, SIZES
from .configs import FAMILY, KNOWN, load_model
from .measured import validate
from .memory import plan
from .search import best_per_group, layouts, recommend

DESCRIPTION = "Memory planner: per-rank memory of a training step for each layout, and the one to use."
REQUIRED = ("seq_len", "gpus", "gpu_memory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m seqpar_hf.plan",
        description=DESCRIPTION,
        epilog=FAMILY[0].upper() + FAMILY[1:] + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a transformers config.json (or its folder), or one of: {', '.join(KNOWN)}",
    )
    for name in SIZES:
        parser.add_argument(
            _flag(name),
            dest=name,
            type=int,
            help=f"override the model's {name.replace('_', ' ')} ({checks.MEANING[name]})",
        )
        if "_" in name:  # the spelling of earlier versions, still accepted
            parser.add_argument(f"--{name}", dest=name, type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--validate",
        metavar="JSON",
        help="compare with benchmarks/results/longest_sequence.json (measured peaks) and exit",
    )
    parser.add_argument("--seq-len", type=int, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per SP group and step")
    parser.add_argument("--gpus", type=int, help="ranks in all (dp x sp x tp)")
    parser.add_argument("--gpu-memory", type=float, help="GiB per rank")
    parser.add_argument(
        "--reserve",
        type=float,
        default=0.1,
        help="fraction of each rank's memory kept free (allocator fragmentation, kernels' workspace)",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="bf16",
        help="activations' precision (bf16: bf16 weights with fp32 master weights, gradients, moments)",
    )
    parser.add_argument(
        "--offload-activations",
        action="store_true",
        help="also count checkpointed layouts whose layer inputs wait in host memory (--sp_offload_activations)",
    )
    parser.add_argument(
        "--tiled-mlp",
        action="store_true",
        help="also count layouts whose MLP runs over sequence tiles of hidden-size tokens (--sp_tiled_mlp)",
    )
    parser.add_argument("--all", action="store_true", help="print every layout, not only the best per sp x tp")
    return parser


def _flag(name: str) -> str:
    """Every flag is spelled with dashes (`--kv-heads`; `--kv_heads` is accepted too)."""
    return "--" + name.replace("_", "-")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Every argument, before any work: (model, budget in bytes), or parser.error (exit code 2)."""
    try:
        for name in ("seq_len", "gpus", "batch") + SIZES:
            if getattr(args, name) is not None:
                checks.positive_int(_flag(name), getattr(args, name))
        budget = checks.budget_bytes(args.gpu_memory, args.reserve, names=("--gpu-memory", "--reserve"))
        overrides = {k: getattr(args, k) for k in SIZES if getattr(args, k) is not None}
        try:
            model = load_model(args.model)
        except ValueError as e:
            raise ValueError(f"--model {e}") from None
        # a known model's or a config's sizes with the overrides: named by flag if given, else by the model
        sizes = {**{k: getattr(model, k) for k in SIZES + ("tied",)}, **overrides}
        checks.model_sizes(sizes, name_of=lambda k: _flag(k) if k in overrides else f"{k} of --model {args.model}")
        return replace(model, **overrides), budget
    except ValueError as e:
        parser.error(str(e))


def main(argv=None):
    """The plan's table and recommendation (returned: the recommended Breakdown, None when nothing fits);
    with --validate, the comparison with the measured peaks (returned: its rows)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.validate:
        defaults = vars(parser.parse_args([]))
        extra = [_flag(k) for k, v in vars(args).items() if k != "validate" and v != defaults[k]]
        if extra:
            parser.error(f"--validate reads the model and the lengths from its json: drop {', '.join(extra)}")
        try:
            return validate(args.validate)
        except ValueError as e:
            parser.error(f"--validate {e}")
    missing = [_flag(n) for n in REQUIRED if getattr(args, n) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required")
    model, budget = check_args(parser, args)
    elem = 2 if args.dtype == "bf16" else 4  # bytes per element
    candidates = layouts(model, args.gpus, args.offload_activations, args.tiled_mlp)
    rows = [plan(model, layout, args.seq_len, args.gpus, elem, args.batch) for layout in candidates]
    print(
        f"model: {model.params / 1e9:.2f}B parameters ({model.layers} layers, hidden {model.hidden}, "
        f"{model.heads}/{model.kv_heads} heads, ffn {model.ffn}, vocab {model.vocab}); {args.seq_len} tokens x "
        f"{args.batch}; {args.gpus} ranks of {args.gpu_memory:g} GiB ({budget / GIB:.1f} usable); {args.dtype}"
    )
    shown = rows if args.all else best_per_group(rows, budget)
    width = max([44] + [len(r.layout.describe()) for r in shown])
    print(
        f"{'layout':{width}s} {'states':>8s} {'fsdp':>7s} {'activ.':>8s} {'logits':>8s} {'comm':>7s} "
        f"{'peak GiB':>9s}  at"
    )
    for r in shown:
        p = r.parts
        print(
            f"{r.layout.describe():{width}s} {p['states'] / GIB:8.2f} {p['fsdp_gathered'] / GIB:7.2f} "
            f"{p['activations'] / GIB:8.2f} {p['logits'] / GIB:8.2f} {p['communication'] / GIB:7.2f} "
            f"{r.peak / GIB:9.2f}  {r.moment}{'' if r.peak <= budget else '  (does not fit)'}"
        )
    print(howto.LEGEND)
    best = recommend(rows, budget)
    if best is None:
        smallest = min(rows, key=lambda r: r.peak)
        # a bf16 run is not told to use bf16
        remedies = (
            "more ranks or a shorter sequence" if args.dtype == "bf16" else "more ranks, a shorter sequence, or bf16"
        )
        print(
            f"nothing fits: the smallest peak, {smallest.peak / GIB:.1f} GiB ({smallest.layout.describe()}), is above "
            f"the {budget / GIB:.1f} GiB usable per rank ({args.gpu_memory:g} GiB less the {args.reserve:.0%} "
            f"reserve); {remedies}"
        )
    else:
        dp = args.gpus // (best.layout.sp * best.layout.tp)
        print(
            f"recommended: {best.layout.describe()}, dp={dp}, FSDP over {dp * best.layout.sp} ranks; "
            f"peak {best.peak / GIB:.1f} GiB of {budget / GIB:.1f}"
        )
        if best.layout.offload:
            print(offload.describe(offload.traffic(model, best.layout, args.seq_len, args.gpus, elem, args.batch)))
        logits = args.batch * -(-args.seq_len // best.layout.sp) * model.vocab  # one rank's [tokens, vocab]
        print("\n".join(howto.run_lines(best.layout, args.gpus, args.dtype, logits)))
    return best
