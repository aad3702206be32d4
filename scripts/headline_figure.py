"""The README's headline figure, drawn from data already committed: overhead / final KV of four designs at the
PR's shape (Llama-2-7B, bf16, batch 8, prompt 300, 500 new tokens, greedy).

Bars: the Llama-2-7B twin measured on CPU by the CPU allocator (data/cpu/results.csv, the rows of
`python -m kvlab compare --batch 8 --new 500`). Diamonds: the releases' own generate() on one H200 with the full
Llama-2-7B config (data/design/h200.csv). Usage:

    python scripts/headline_figure.py                # writes docs/images/headline.png
    python scripts/headline_figure.py --out X.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "data" / "cpu" / "results.csv"
H200 = ROOT / "data" / "design" / "h200.csv"
OUT = ROOT / "docs" / "images" / "headline.png"
SHAPE = {"batch": "8", "prompt": "300", "new": "500", "dtype": "bfloat16", "strategy": "greedy"}
# (cache, loop, label under the bar): <= 4.41, the PR as released in 4.42, today's loop, kvlab's own design.
DESIGNS = [
    ("tuple", "v4.40", "tuple/v4.40\ntransformers ≤ 4.41"),
    ("dynamic", "v4.42", "dynamic/v4.42\n4.42 (PR #30536)"),
    ("dynamic", "v5", "dynamic/v5\ntransformers 5.x"),
    ("prealloc", "v5", "prealloc/v5\nkvlab's in-place buffer"),
]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def headline_values() -> list[dict]:
    """One dict per design: its label, the twin's overhead / final KV and bytes, the H200's ratio (or None)."""
    cpu = [
        r
        for r in _rows(CPU)
        if r["status"] == "ok" and r["preset"] == "llama2-7b-twin" and all(r[k] == v for k, v in SHAPE.items())
    ]
    h200 = [r for r in _rows(H200) if r["preset"] == "llama2-7b" and all(r[k] == v for k, v in SHAPE.items())]
    values = []
    for cache, loop, label in DESIGNS:
        (row,) = [r for r in cpu if (r["cache"], r["loop"]) == (cache, loop)]
        gpu = [r for r in h200 if (r["cache"], r["loop"]) == (cache, loop)]
        values.append(
            {
                "cache": cache,
                "loop": loop,
                "label": label,
                "ratio": float(row["overhead_over_kv"]),
                "overhead_bytes": int(row["overhead_bytes"]),
                "kv_final_bytes": int(row["kv_final_bytes"]),
                "h200_ratio": float(gpu[0]["overhead_over_kv"]) if gpu else None,
                "h200_release": gpu[0]["release"] if gpu else None,
                "h200_kv_gib": float(gpu[0]["kv_final_gib"]) if gpu else None,
            }
        )
    return values


def draw(out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    values = headline_values()
    kv_mib = values[0]["kv_final_bytes"] / 2**20
    kv_gib = next(v["h200_kv_gib"] for v in values if v["h200_kv_gib"])
    x = range(len(values))
    fig, ax = plt.subplots(figsize=(9, 4.6), dpi=100)
    colors = ["#c0392b", "#2e86c1", "#2e86c1", "#7f8c8d"]
    bars = ax.bar(x, [v["ratio"] for v in values], width=0.55, color=colors, zorder=2)
    for bar, v in zip(bars, values):
        ax.annotate(
            f"{v['ratio']:.2f} × KV" if v["ratio"] > 1.5 else f"{v['ratio']:.3f} × KV",
            (bar.get_x() + bar.get_width() / 2, v["ratio"]),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=10,
        )
    # The H200 points sit beside their bar, not on it, so that neither hides the other.
    gx = [i + 0.36 for i, v in enumerate(values) if v["h200_ratio"]]
    gy = [v["h200_ratio"] for v in values if v["h200_ratio"]]
    ax.scatter(gx, gy, marker="D", s=46, color="black", zorder=3)
    ax.axhline(1, color="0.35", lw=0.8, ls="--", zorder=1)
    ax.axhline(2, color="0.35", lw=0.8, ls="--", zorder=1)
    ax.text(3.4, 1.0, "one final cache", ha="left", va="center", fontsize=8.5, color="0.3", backgroundcolor="white")
    ax.text(3.4, 2.0, "two final caches", ha="left", va="center", fontsize=8.5, color="0.3", backgroundcolor="white")
    ax.set_xticks(list(x), [v["label"] for v in values], fontsize=9.5)
    ax.set_xlim(-0.5, 4.05)
    ax.set_ylim(0, 2.55)
    ax.set_ylabel("overhead / final KV (× KV)")
    ax.set_title(
        "Before 4.42 generate() held two KV caches at its peak; since 4.42, one\n"
        f"Llama-2-7B, bf16, batch 8, prompt 300, 500 new tokens, greedy; final KV {kv_gib:.3f} GiB "
        f"(twin: {kv_mib:.0f} MiB)",
        fontsize=10.5,
    )
    handles = [
        Patch(facecolor="0.65", label="bars: the twin (every width / 32), measured on CPU by kvlab's meter"),
        Line2D(
            [],
            [],
            marker="D",
            ls="",
            color="black",
            label="H200, full model: the release's own generate() (4.40.1, 5.17)",
        ),
    ]
    ax.legend(handles=handles, loc="upper right", fontsize=8.5, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    path = draw(args.out)
    print(f"{path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
