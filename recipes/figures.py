"""What the recipes' figure scripts share: matplotlib imported only when drawing (an optional extra,
`pip install -e ".[bench]"`), and a figure written as a PNG."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")  # long legends and notes stay whole
    pyplot().close(fig)
    return out
