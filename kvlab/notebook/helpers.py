"""What lessons 01-03 share besides their figures (kvlab.notebook.figures, one module per lesson): MiB, the figures'
width and theme, the device's name, step peaks, and lesson 02's excerpts of PR #30536 and their diff (the
measurements themselves come from kvlab.lab.point and kvlab.meter)."""

from __future__ import annotations

import pandas as pd
import seaborn as sns

MIB = 2**20
WIDTH = 10  # inches: ≈ 1000 px at the notebooks' 100 dpi, the most a notebook shows without shrinking labels


def step_peaks(reports: dict, step: int) -> pd.Series:
    """Peak inside one decoding step (MiB) for each labelled report."""
    return pd.Series(
        {name: report.timeline[step].peak_bytes / MIB for name, report in reports.items()},
        name=f"peak in step {step} (MiB)",
    )


def set_theme():
    """One look for every notebook's figures (seaborn's whitegrid, tab10 colours)."""
    sns.set_theme(style="whitegrid", palette="tab10", context="notebook", font_scale=0.85)


def device_label(device: str) -> str:
    """The one way notebooks name their device: the processor or GPU model, then the torch device."""
    from ..models import device_name

    return f"{device_name(device)} ({device})"


EXCERPTS_FILE = "reference/pr30536_excerpts.json"  # under data/: kvlab.releases.cut_excerpts' cut, committed


def release_excerpts(data_dir) -> dict:
    """{release: {title: {"path", "line", "lines"}}}: the lines of transformers 4.40.1 and 4.42.4 that lesson 02
    compares, as kvlab.releases.cut_excerpts cuts them from the installed releases (committed in `data_dir`, so that
    a lesson needs no old release installed; tests/test_reference.py holds the copy to the releases)."""
    import json
    from pathlib import Path

    return json.loads((Path(data_dir) / EXCERPTS_FILE).read_text())


GITHUB_LINE = "https://github.com/huggingface/transformers/blob/v{version}/src/transformers/{path}#L{line}"


def release_diff(excerpts: dict, titles) -> str:
    """Markdown: each excerpt of `release_excerpts` named in `titles`, as a unified diff of 4.40.1's lines against
    4.42.4's (`-` 4.40.1's alone, `+` 4.42.4's alone; an unchanged one shown whole), linked to both releases' lines."""
    import difflib

    blocks = []
    for title in titles:
        before, after = excerpts["4.40.1"][title], excerpts["4.42.4"][title]
        indent = min(len(s) - len(s.lstrip()) for s in before["lines"] + after["lines"] if s.strip())
        old, new = ("\n".join(s[indent:] for s in e["lines"]).rstrip().splitlines() for e in (before, after))
        diff = list(difflib.unified_diff(old, new, lineterm="", n=len(old) + len(new)))[3:]  # no header
        links = ", ".join(
            f"[{v} line {e[title]['line']}]({GITHUB_LINE.format(version=v, **e[title])})" for v, e in excerpts.items()
        )
        body = "\n".join(diff or [" " + s for s in old])
        blocks.append(f"**{title}** ({'changed' if diff else '**unchanged**'}; {links})\n```diff\n{body}\n```")
    return "\n\n".join(blocks)
