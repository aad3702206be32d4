"""The surface a user meets: the README's Python example runs as written, the lesson needs none of the extras, the
installed `kvlab` command runs a command once, and every number of the README's results is what its lesson shows."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from kvlab import theory
from kvlab.configs import build_config
from kvlab.planner import theory as planner_theory

ROOT = Path(__file__).resolve().parents[1]
# What only the extras bring (pyproject.toml: lab, notebooks, jupyter, ray); torch and transformers bring the rest.
EXTRAS_ONLY = (
    "papermill",
    "nbformat",
    "ipykernel",
    "pandas",
    "psutil",
    "matplotlib",
    "seaborn",
    "ipywidgets",
    "jupyterlab",
    "ray",
)
# Run before the example: each of those modules then fails to import, and looks absent to transformers' checks
# (importlib.util.find_spec gives None), as where the extras are not installed.
WITHOUT_EXTRAS = f"import sys\nsys.modules.update(dict.fromkeys({EXTRAS_ONLY!r}))\n"


def readme_example() -> str:
    """The Python block of the README's "Using kvlab" section, as a reader copies it."""
    section = (ROOT / "README.md").read_text().split("## Using kvlab", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_python(code: str, tmp_path: Path) -> str:
    """`code` in a fresh interpreter, from a folder outside the checkout, on the CPU; its output."""
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_readme_example_runs_as_written_without_the_extras(tmp_path):
    """The five public names, used as the README shows; its measured overheads are the theory's (the README's
    0.08 % for stored points), and transformers' own generate() decodes the same tokens into kvlab's cache."""
    output = run_python(WITHOUT_EXTRAS + readme_example(), tmp_path)
    assert re.search(r"^prealloc/v5 +[0-9.]+ .* yes ", output, re.M), output  # predict's table, with "fits"
    config = build_config("llama2-7b-twin")
    printed = re.findall(
        r"^(\w+)/(v[0-9.]+): ([0-9.]+) MiB at the peak .*, ([0-9.]+) of it inside kernels", output, re.M
    )
    assert [(cache, loop) for cache, loop, *_ in printed] == [("tuple", "v4.40"), ("dynamic", "v5")], output
    for cache, loop, mib, kernels in printed:
        predicted = theory.predict_overhead(
            config, batch=1, prompt=300, new=40, dtype="bfloat16", cache=cache, loop=loop
        )
        # The theory counts tensors; a kernel's own scratch (a bf16 matmul's) depends on the CPU's kernel library.
        assert (float(mib) - float(kernels)) * 2**20 == pytest.approx(predicted, rel=1e-3), (cache, loop)
    assert "same tokens as transformers' generate(): True" in output


@pytest.mark.parametrize(
    "command",
    [[str(Path(sys.executable).parent / "kvlab")], [sys.executable, "-m", "kvlab"]],
    ids=["console-script", "python-m"],
)
def test_the_installed_command_runs_a_command_once(command, tmp_path):
    result = subprocess.run(
        [*command, "predict", "--preset", "toy", "--batch", "1", "--prompt", "8", "--new", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("toy: llama, 4 layers") == 1, result.stdout


def test_the_command_line_needs_no_extra_to_predict_and_names_the_extra_a_sweep_needs(tmp_path):
    predict = run_python(
        WITHOUT_EXTRAS + "from kvlab.cli import main\n"
        "main(['predict', '--preset', 'toy', '--batch', '1', '--prompt', '8', '--new', '2'])\n",
        tmp_path,
    )
    assert predict.count("toy: llama, 4 layers") == 1
    sweep = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_EXTRAS + "from kvlab.cli import main\n"
            "main(['sweep', 'cpu-batch', '--grid', 'preset=toy', '--out', 'out'])\n",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert sweep.returncode == 1 and "pip install 'kvlab[lab]'" in sweep.stderr, sweep.stderr[-2000:]


README_MAX_BYTES = 12 * 1024  # a newcomer reads it in two minutes; depth lives in docs/
HEADLINE_LINES = 40  # the headline figure shows before the reader scrolls far
IMAGE_MAX_BYTES = 150 * 1024
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def test_readme_is_short_and_shows_its_headline_figure_first():
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; at most {README_MAX_BYTES:,} (move depth to docs/)"
    head = readme.read_text().splitlines()[:HEADLINE_LINES]
    images = [m.group(1) for line in head for m in LINK.finditer(line) if m.group(0).startswith("!")]
    assert images, f"no image link in README.md's first {HEADLINE_LINES} lines"
    for image in images:
        path = ROOT / image
        assert path.is_file(), f"README's image {image} is not committed"
        assert path.stat().st_size < IMAGE_MAX_BYTES, f"{image}: {path.stat().st_size:,} bytes"


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))])
def test_every_relative_link_of_the_readme_and_docs_points_at_something_that_exists(page):
    """What left the README for docs/ stays reachable: every relative link (and its #anchor) resolves."""
    source = ROOT / page
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...: sources, not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


def test_the_headline_figure_is_drawn_from_committed_data(tmp_path):
    """scripts/headline_figure.py reads data/cpu and data/design: <= 4.41 at two caches, every later design at one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("headline_figure", ROOT / "scripts" / "headline_figure.py")
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    values = {(v["cache"], v["loop"]): v for v in figure.headline_values()}
    assert values["tuple", "v4.40"]["ratio"] == pytest.approx(2.0, abs=0.01)
    assert values["tuple", "v4.40"]["h200_ratio"] == pytest.approx(2.0, abs=0.01)
    for design in [("dynamic", "v4.42"), ("dynamic", "v5"), ("prealloc", "v5")]:
        assert 1.0 < values[design]["ratio"] < 1.02, design
    assert values["dynamic", "v5"]["h200_ratio"] == pytest.approx(values["dynamic", "v5"]["ratio"], abs=0.001)
    pytest.importorskip("matplotlib")
    drawn = figure.draw(tmp_path / "headline.png")
    assert 0 < drawn.stat().st_size < IMAGE_MAX_BYTES


# The README's results table against what the lessons show. For every row: each number of its "measured" cell, in
# order, is the one its source shows (the linked lesson's committed outputs, or the committed data the row names), to
# the digits the README prints; each shape its "finding" cell states is the lesson's. A rerun that moves a number, a
# README edit, or a number added to a row without a source fails here until the two agree again.
NOTEBOOKS_DIR = ROOT / "notebooks"
# A number as the README writes one: not inside a word, a name or a version (Llama-2-7B, int4, H200, #31962, 4.40.1).
NUMBER = re.compile(r"(?<![\w#.\-/])[−-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w.])")
VERSION = re.compile(r"\d+\.\d+\.\d+")


class Within(float):
    """A source value the README states as a bound ("within 0.08 %"): its number may not be below it."""


def printed(notebook: str) -> str:
    """All that a committed notebook shows as text (streams, results' plain text and HTML), cell after cell."""
    from kvlab.notebook.tools import output_text

    nb = nbformat.read(NOTEBOOKS_DIR / notebook, as_version=4)
    return "\n".join(output_text(o) for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))


def parameters(notebook: str) -> dict:
    """The values a notebook's `parameters` cell assigns, the ones its committed run used."""
    from kvlab.notebook.tools import parameters_cells

    nb = nbformat.read(NOTEBOOKS_DIR / notebook, as_version=4)
    (index,) = parameters_cells(nb)
    tree = ast.parse(nb.cells[index].source)
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }


def shown(pattern: str, text: str) -> float:
    """The number the first match of `pattern` (one group) captures in `text`."""
    found = re.search(pattern, text, re.M)
    assert found, f"nothing matches {pattern!r}"
    return float(found.group(1).replace(",", ""))


def _greedy():
    lesson, h200 = printed("02_tuple_vs_dynamic.ipynb"), pd.read_csv(ROOT / "data/design/h200.csv")
    h200 = h200[(h200["preset"] == "llama2-7b") & (h200["strategy"] == "greedy")].set_index(["cache", "release"])
    old, new = h200.loc[("tuple", "4.40.1")], h200.loc[("dynamic", "5.17.0")]
    p = parameters("02_tuple_vs_dynamic.ipynb")
    measured = [
        shown(r"^tuple/v4\.40 +[\d.]+ +([\d.]+)", lesson),
        shown(r"^dynamic/v4\.42 +[\d.]+ +([\d.]+)", lesson),
        old["overhead_over_kv"],
        new["overhead_over_kv"],
    ]
    assert old["prompt"] == new["prompt"] == p["prompt"], "the row states one prompt for the twin and the H200"
    finding = {
        r"prompt (\d+)": p["prompt"],
        r"twin: batch (\d+)": p["batch"],
        r"twin: batch \d+, (\d+) new": p["new"],
        r"H200: batch (\d+)": old["batch"],
        r"H200: batch \d+, (\d+) new": old["new"],
    }
    return measured, finding


def _minimal():
    lesson = printed("03_analysis.ipynb")
    measured = [
        shown(r"^minimal, Llama-2-7B +([\d.]+) +[\d.]+ *$", lesson),
        shown(r"under the real releases' own generate\(\) .*: ([\d.]+)$", lesson),
    ]
    finding = {
        r"≈ ([\d.]+) Llama-2": shown(r"^minimal, Llama-2-7B +≈ ([\d.]+)", lesson),
        r"≈ ([\d.]+) Mistral": shown(r"^minimal, Mistral-7B +≈ ([\d.]+)", lesson),
    }
    return measured, finding


def _beam():
    lesson, p = printed("04_strategies_and_restart.ipynb"), parameters("04_strategies_and_restart.ipynb")
    line = re.search(
        r"^beam search: tuple/v4\.40 ([\d.]+)× → dynamic/v4\.42 ([\d.]+)× the final KV "
        r"\(real 4\.40\.1: ([\d.]+)×, real 4\.42\.4: ([\d.]+)×\)",
        lesson,
        re.M,
    )
    assert line, "lesson 04 prints no beam-search line with the real releases"
    finding = {
        r"(\d+) beams": p["num_beams"],
        r"batch (\d+)": p["batch"],
        r"prompt (\d+)": p["prompt"],
        r"(\d+) new": p["new"],
    }
    return [float(x) for x in line.groups()], finding


def _restart():
    lesson, p = printed("04_strategies_and_restart.ipynb"), parameters("04_strategies_and_restart.ipynb")
    line = re.search(
        r"^dynamic/v4\.42, tuples returned \(4\.42's default\): overhead / final KV ([\d.]+)× "
        r"\(real 4\.42\.4: ([\d.]+)×\)",
        lesson,
        re.M,
    )
    assert line, "lesson 04 prints no line for 4.42's default restart with the real release"
    return [float(x) for x in line.groups()], {r"(\d+) new, then": p["new"], r"then (\d+) more": p["restart_new"]}


def _smollm2():
    lesson = printed("01_torch_cat_copies.ipynb")
    ratios = re.search(r"^overhead / final KV: (.*)$", lesson, re.M).group(1)
    shape = re.search(r"^SmolLM2-135M, \w+, batch (\d+), prompt (\d+), (\d+) new", lesson, re.M)
    assert shape, "lesson 01 prints no SmolLM2 shape line"
    measured = [float(value) for value in re.findall(r"(\d+\.\d+) \(\w+/v[\d.]+\)", ratios)]
    finding = dict(zip((r"batch (\d+)", r"prompt (\d+)", r"(\d+) new"), map(int, shape.groups())))
    return measured, finding


def _releases():
    table = (ROOT / "data/reference/fidelity.md").read_text()
    ratios = [float(ratio) for ratio in re.findall(r"^\|.*\| (\d\.\d{4}) \|$", table, re.M)]  # kvlab / real
    return [min(ratios), max(ratios), len(ratios)], {}


def _traced():
    lesson = printed("04_strategies_and_restart.ipynb")
    return [shown(r"^jit-trace tuple: ([\d.]+)× the final KV", lesson), shown(r"^export static: ([\d.]+)×", lesson)], {}


def _reused():
    lesson = printed("A10_encoder_decoder_static_cache.ipynb")
    measured = [
        shown(r"The reused buffers, held at every request after the first: ([\d.]+) MiB", lesson),
        shown(r"newly held after the first request: hf-static ([\d.]+) MiB", lesson),
    ]
    return measured, {r"(\d+) t5-small requests": shown(r": (\d+) requests, batch", lesson)}


def _todays():
    lesson = printed("05_todays_generate.ipynb")
    measured = [
        shown(r"^prompt 4608: .* the mask is ([\d.]+) % of that peak", lesson),
        shown(r"^prompt 32768: .* the mask is ([\d.]+) % of that peak", lesson),
        shown(r"^prompt (32768): ", lesson),
        shown(r"^long-greedy, the twin: the mask [\d.]+ MiB, (\d+)% of its peak", lesson),
        shown(r"^long-greedy: overhead ([\d.]+) MiB", lesson),
        shown(r"^long-greedy: overhead .* prefill_chunk_size=32 ([\d.]+) MiB", lesson),
    ]
    finding = {
        r"prompt (\d+)": shown(r"^prompt (\d+): the mask", lesson),
        r"window (\d+)": shown(r"^mistral-7b-v0\.1: \d+ of its \d+ layers slide, window (\d+)", lesson),
    }
    return measured, finding


def _theory():
    """kvlab.planner.theory (kvlab.theory's walk, with the exported programs' phases) against every kvlab point stored
    under data/: the largest error (%) and how many points."""
    from kvlab import schema

    counts = ("batch", "prompt", "new", "restart_new", "num_beams", "chunk_limit", "block_tokens")
    errors = []
    for path in sorted((ROOT / "data").glob("*/results.csv")):
        table = pd.read_csv(path)
        if "overhead_bytes" not in table:  # data/speed: timings only
            continue
        table = table[(table.get("status", "ok") == "ok") & (table.get("kind", "kvlab") == "kvlab")]
        for _, row in table.iterrows():
            point = {k: int(row[k]) if k in counts else row[k] for k in schema.POINT_KEYS if pd.notna(row.get(k))}
            overrides = row["overrides"] if pd.notna(row["overrides"]) else None
            predicted = planner_theory.predict_overhead(build_config(row["preset"], overrides), **point)
            errors.append(abs(row["overhead_bytes"] / predicted - 1))
    return [Within(100 * max(errors)), len(errors)], {}


SAVERS = ("fp8", "quanto-int4", "hqq-int4", "sliding")  # in the row's order


def _savers():
    lesson = printed("A11_dry_run_and_savers.ipynb")
    data = pd.read_csv(ROOT / "data/today/savers.csv").set_index("saver")
    measured = []
    for saver in SAVERS:  # the HTML table: model, KV saved, predicted, peak saved, predicted, ...
        cells = re.search(
            rf"<th>{saver}</th>\s*<td>([^<]*)</td>\s*<td>[^<]*\((-?[\d.]+)%\)</td>\s*<td>[^<]*</td>\s*"
            rf"<td>[^<]*\((-?[\d.]+)%\)</td>",
            lesson,
        )
        assert cells, f"appendix A11 shows no savers row for {saver}"
        window = re.search(r"sliding_window=(\d+)", cells.group(1))
        measured += ([float(window.group(1))] if window else []) + [float(cells.group(2)), float(cells.group(3))]
    rows = data.loc[list(SAVERS)]
    errors = pd.concat(
        [
            (rows["kv_saved_bytes"] / rows["kv_saved_predicted_bytes"] - 1).abs(),
            (rows["peak_saved_bytes"] / rows["peak_saved_predicted_bytes"] - 1).abs(),
        ]
    )
    twin = rows[rows["preset"] == "llama2-7b-twin"]
    finding = {r"prompt (\d+)": twin["prompt"].unique().item(), r"(\d+) new": twin["new"].unique().item()}
    return [*measured, Within(100 * errors.max())], finding


# Each README results row: how its first cell begins, what its "where" cell links, where its numbers come from.
README_ROWS = {
    "greedy": ("greedy, Llama-2-7B", "notebooks/02_tuple_vs_dynamic.ipynb", _greedy),
    "minimal": ('the PR\'s "minimal improvement"', "notebooks/03_analysis.ipynb", _minimal),
    "beam": ("beam search,", "notebooks/04_strategies_and_restart.ipynb", _beam),
    "restart": ("4.42's default restart", "notebooks/04_strategies_and_restart.ipynb", _restart),
    "smollm2": ("the running example, SmolLM2-135M", "notebooks/01_torch_cat_copies.ipynb", _smollm2),
    "releases": ("kvlab's loops against the real", "docs/results.md#the-real-releases-matched-cpu", _releases),
    "traced": ("a traced graph", "notebooks/04_strategies_and_restart.ipynb", _traced),
    "reused": ("one reused static cache", "notebooks/A10_encoder_decoder_static_cache.ipynb", _reused),
    "todays": ("5.24's own `generate()`", "notebooks/05_todays_generate.ipynb", _todays),
    "theory": ("`kvlab.planner.theory` against every stored point", "docs/results.md#theory", _theory),
    "savers": ("today's memory savers", "notebooks/A11_dry_run_and_savers.ipynb", _savers),
}


def readme_results() -> list[list[str]]:
    """The README's results table: each row's finding, measured and where cells."""
    section = (ROOT / "README.md").read_text().split("## Results", 1)[1]
    lines = section.split("|---|---|---|\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def readme_numbers(cell: str) -> list[str]:
    """The numbers of a README cell in order, code spans and release versions left out."""
    return NUMBER.findall(VERSION.sub(" ", re.sub(r"`[^`]*`", " ", cell)))


def agrees(written: str, source: float) -> bool:
    """The README's number is the source's at the README's digits (or, for a bound, not below the source's)."""
    value = float(written.replace(",", "").replace("−", "-"))
    if isinstance(source, Within):
        return value >= source
    return abs(value - source) <= 0.5 * 10 ** -len(written.partition(".")[2]) + 1e-9


def test_every_readme_results_row_has_its_source():
    starts = [row[0] for row in readme_results()]
    assert len(starts) == len(README_ROWS), starts
    for start, *_ in README_ROWS.values():
        assert sum(s.startswith(start) for s in starts) == 1, (start, starts)


@pytest.mark.parametrize("name", README_ROWS)
def test_readme_results_row_states_what_its_lesson_shows(name):
    start, link, source = README_ROWS[name]
    (row,) = [row for row in readme_results() if row[0].startswith(start)]
    finding, measured, where = row
    assert f"({link})" in where, f"the README's {name} row links {where}, not {link}"
    values, shapes = source()
    written = readme_numbers(measured)
    assert len(written) == len(values), f"{name}: the README writes {written}, its source shows {values}"
    wrong = [(w, v) for w, v in zip(written, values) if not agrees(w, v)]
    assert not wrong, f"{name}: README number vs what its source shows: {wrong}"
    for pattern, value in shapes.items():
        found = re.search(pattern, finding)
        assert found and agrees(found.group(1), value), f"{name}: {pattern!r} in {finding!r}: the source has {value}"
