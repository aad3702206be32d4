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


# Notebook 02's diff of PR #30536: the places of transformers 4.40.1 and 4.42.4 that decide what greedy decoding
# with a Llama model holds (the copy and the logits are unchanged; the others the PR changed). Each: a title, the
# file under transformers/, and per release the line after which to look (a def, a class or a unique line), the
# excerpt's first line and the line that ends it (not included), each as its text begins, indentation aside.
# 4.40.1's greedy search is `_greedy_search`; 4.42.4's generate() sends it to `_sample` (its `_greedy_search` is a
# deprecated wrapper). 4.42.4's excerpt of the cache it is given stops before the deprecation warning it logs.
PR_EXCERPTS = [
    (
        "DynamicCache.update: the copy",
        "cache_utils.py",
        {
            version: ("class DynamicCache(", "self.key_cache[layer_idx] = torch.cat", "return self.key")
            for version in ("4.40.1", "4.42.4")
        },
    ),
    (
        "LlamaModel.forward: the cache it is given",
        "models/llama/modeling_llama.py",
        {
            "4.40.1": ("class LlamaModel(", "past_seen_tokens = 0", "if cache_position is None:"),
            "4.42.4": ("class LlamaModel(", "return_legacy_cache = False", "logger.warning_once("),
        },
    ),
    (
        "LlamaModel.forward: the cache it returns",
        "models/llama/modeling_llama.py",
        {
            "4.40.1": ("class LlamaModel(", "next_cache = None", "if not return_dict:"),
            "4.42.4": ("class LlamaModel(", "next_cache = next_decoder_cache", "if not return_dict:"),
        },
    ),
    (
        "generate(): the cache it starts with (4.42.4: the branch for no `cache_implementation`)",
        "generation/utils.py",
        {
            "4.40.1": ("def generate(", "self._validate_generated_length(", "# 7. determine"),
            "4.42.4": ("def generate(", "# Use DynamicCache() instance by default", "# 7. determine"),
        },
    ),
    (
        "the greedy loop (4.42.4: `_sample`, where generate() sends greedy search): the next token's logits",
        "generation/utils.py",
        {
            "4.40.1": ("def _greedy_search(", "if synced_gpus and", "# pre-process"),
            "4.42.4": ("def _sample(", "if synced_gpus and", "# pre-process"),
        },
    ),
    (
        "the greedy loop (4.42.4: `_sample`): the end of a step",
        "generation/utils.py",
        {
            "4.40.1": ("def _greedy_search(", "unfinished_sequences = unfinished", "if streamer"),
            "4.42.4": ("def _sample(", "unfinished_sequences = unfinished", "if streamer"),
        },
    ),
    (
        "LlamaForCausalLM.forward: the logits",
        "models/llama/modeling_llama.py",
        {version: ("logits = torch.cat(logits, dim=-1)", "else:", "loss = None") for version in ("4.40.1", "4.42.4")},
    ),
]
PR_EXCERPTS_FILE = "reference/pr30536_excerpts.json"  # under data/: the excerpts where the releases are not installed


def release_excerpts(data_dir) -> tuple[dict, str]:
    """{release: {title: {"path", "line", "lines"}}} for PR_EXCERPTS, cut from the installed 4.40.1 and 4.42.4
    (kvlab.releases) when both are there (and then the same as the committed copy in `data_dir`/PR_EXCERPTS_FILE),
    else read from that copy; and which of the two."""
    import json
    from pathlib import Path

    from ..releases import RELEASES

    folders = {version: RELEASES[version][0] / "transformers" for version in ("4.40.1", "4.42.4")}
    if not all(folder.is_dir() for folder in folders.values()):
        return json.loads((Path(data_dir) / PR_EXCERPTS_FILE).read_text()), "the excerpt committed in data/"
    excerpts = {version: {} for version in folders}
    for title, path, anchors in PR_EXCERPTS:
        for version, (after, start, stop) in anchors.items():
            lines = (folders[version] / path).read_text().splitlines()
            first = next(i for i, line in enumerate(lines) if line.lstrip().startswith(after))
            begin = next(i for i in range(first, len(lines)) if lines[i].lstrip().startswith(start))
            end = next(i for i in range(begin + 1, len(lines)) if lines[i].lstrip().startswith(stop))
            excerpts[version][title] = {"path": path, "line": begin + 1, "lines": lines[begin:end]}
    committed = Path(data_dir) / PR_EXCERPTS_FILE
    if committed.is_file() and json.loads(committed.read_text()) != excerpts:
        raise ValueError(f"data/{PR_EXCERPTS_FILE} differs from the installed releases: write it again")
    return excerpts, "the installed releases"


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
