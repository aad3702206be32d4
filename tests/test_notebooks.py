"""Every notebook executes with tiny parameters on CPU, and every committed notebook is presentable.

(a) Execution: each notebooks/*.ipynb runs top to bottom under papermill with `tiny=True` (every notebook
    declares that switch; output parameters are pointed into a tmp dir), from notebooks/ as in Jupyter.
(b) Committed state (kvlab.notebook.tools.problems): executed, no error, warning or machine path in the outputs,
    no papermill metadata or per-cell timestamps, the kvlab kernelspec, exactly one `parameters` cell, and
    the badge and Colab setup cell generated from kvlab.notebook.colab's one repository URL.
(c) The README's badges and links agree with that URL and with the notebooks that exist; `make lab`
    registers the kernel under its own name, not `python3`.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import nbformat
import pytest

from kvlab.lab import kernel
from kvlab.notebook import colab
from kvlab.notebook.tools import (
    LESSON_WORDS,
    LESSONS_WORDS,
    declared_parameters,
    is_lesson,
    problems,
    prose_words,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
# not the hidden file `kvlab.notebook run` writes beside a notebook while it executes it
NOTEBOOKS = sorted(path for path in NOTEBOOKS_DIR.glob("*.ipynb") if not path.name.startswith("."))
# Parameters that name a file or folder the notebook writes: pointed into the tmp dir.
OUTPUT_PARAMETERS = ("record_path", "out", "out_dir", "output_dir", "output_path")


def _ids(paths):
    return [path.stem for path in paths]


def tiny_parameters(path: Path, tmp_path: Path) -> dict:
    declared = declared_parameters(nbformat.read(path, as_version=4))
    assert "tiny" in declared, f"{path.name} has no `tiny` parameter; its parameters: {sorted(declared)}"
    parameters = dict(tiny=True)
    parameters.update({name: str(tmp_path / f"{name}.out") for name in OUTPUT_PARAMETERS if name in declared})
    return parameters


# The lessons run in `make test`; the appendices (A1, A2, ...), depth beyond the lessons, in `make test-all`.
EXECUTED = [path if is_lesson(path.name) else pytest.param(path, marks=pytest.mark.slow) for path in NOTEBOOKS]


@pytest.mark.parametrize("path", EXECUTED, ids=_ids(NOTEBOOKS))
def test_notebook_executes_with_tiny_parameters(path, tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    # The tiny models gain nothing from threads, and on a shared 2-core machine OpenMP threads
    # spinning against other processes make each matmul up to 100x slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # tiny means CPU, even on a GPU machine
    output = tmp_path / path.name
    papermill.execute_notebook(
        str(path),
        str(output),
        parameters=tiny_parameters(path, tmp_path),
        kernel_name=kernel.kernel_name(),
        cwd=str(path.parent),
        progress_bar=False,
        log_output=False,
        extra_arguments=kernel.QUIET_KERNEL,
    )
    executed = nbformat.read(output, as_version=4)
    errors = [
        o
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_notebook_is_executed_and_clean(path):
    nb = nbformat.read(path, as_version=4)
    assert any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
        f"{path.name} has no outputs; commit the executed notebook"
    )
    found = problems(nb, path.name)
    assert not found, f"{path.name} (fix, or `python -m kvlab.notebook run {path.name}`):\n  " + "\n  ".join(found)


def test_the_lessons_are_read_in_an_afternoon():
    """The course, every lesson (01, 02, ... numbered without a gap; not the appendices), holds at most
    LESSONS_WORDS words of prose together, and each lesson at most LESSON_WORDS (that one is also in `problems`)."""
    words = {p.stem: prose_words(nbformat.read(p, as_version=4)) for p in NOTEBOOKS if is_lesson(p.name)}
    assert [name[:2] for name in sorted(words)] == [f"{i:02d}" for i in range(1, len(words) + 1)], sorted(words)
    assert all(count <= LESSON_WORDS for count in words.values()), words
    assert sum(words.values()) <= LESSONS_WORDS, words


def test_prose_words_counts_prose_only():
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell(f"# Title two\n\n{colab.badge('x.ipynb')}\n\nOne, two — three."),
            nbformat.v4.new_markdown_cell("Four:\n\n```python\nnot = counted\n```\n\n| five | six |\n|---|---|"),
            nbformat.v4.new_code_cell("# words in code are not prose"),
        ]
    )
    assert prose_words(nb) == 8  # Title two One, two three. Four: five six ("—", "|", "|---|---|" are not words)


def test_a_lessons_length_order_and_tables_are_checked():
    rows = "".join(f"<tr><td>{i}</td></tr>" for i in range(13))
    table = f"<table><tr><th>a</th></tr>{rows}<tr><td>cut sho…</td></tr></table>"
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# 01 · A title\n\n" + "word " * 1501),
            nbformat.v4.new_code_cell("tiny = False", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell(
                "table",
                execution_count=1,
                outputs=[nbformat.v4.new_output("execute_result", data={"text/html": table})],
            ),
        ]
    )
    found = "\n".join(problems(nb, "01_x.ipynb"))
    for expected in ("cell 1 should be the Colab setup cell", "1504 words", "cut short", "a table of 14 rows"):
        assert expected in found, f"{expected!r} not reported in:\n{found}"
    assert "words" not in "\n".join(problems(nb, "A9_x.ipynb"))  # an appendix has no word limit


def test_problems_are_found():
    """The checker itself: each kind of noise in a notebook is reported."""
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# A title"),
            nbformat.v4.new_code_cell("tiny = False", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell(
                "x",
                execution_count=1,
                outputs=[
                    nbformat.v4.new_output(
                        "stream", name="stderr", text="/x/y.py:3: TqdmWarning: IProgress not found\n"
                    ),
                    nbformat.v4.new_output("stream", name="stdout", text=f"wrote {ROOT}/results/a.csv\n"),
                ],
                metadata={"execution": {"iopub.execute_input": "2026-11-30T10:00:00Z"}},
            ),
        ]
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells[1].execution_count = 1
    found = "\n".join(problems(nb, "x.ipynb"))
    for expected in ("kernelspec", "badge", "setup cell", "TqdmWarning", "machine path", "timestamps"):
        assert expected in found, f"{expected!r} not reported in:\n{found}"


def test_readme_links_every_notebook_and_agrees_with_the_repository_url():
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(notebooks/([^)]+\.ipynb)\)", readme))
    assert linked == {p.name for p in NOTEBOOKS}, (
        f"README links {sorted(linked)}; notebooks/ has {sorted(p.name for p in NOTEBOOKS)}"
    )
    for url in re.findall(r"https://colab\.research\.google\.com/github/[^\s)\"'>]+", readme):
        assert url == colab.colab_url(url.rsplit("/", 1)[1]), (
            f"README's Colab link {url} is not from kvlab.notebook.colab"
        )
    # This repository's URL (links to transformers' PRs and issues are sources, not the repository).
    for url in re.findall(r"https://github\.com/[\w.-]+/kvlab\b[\w.-]*", readme):
        assert url == colab.REPOSITORY, (
            f"README names the repository {url}; kvlab.notebook.colab.REPOSITORY says {colab.REPOSITORY}"
        )


def test_colab_url_comes_from_the_repository():
    assert colab.colab_url("01_x.ipynb", "https://github.com/someone/proj") == (
        "https://colab.research.google.com/github/someone/proj/blob/main/notebooks/01_x.ipynb"
    )
    with pytest.raises(ValueError, match="not a GitHub repository URL"):
        colab.colab_url("01_x.ipynb", "https://example.org/proj")


def test_make_lab_uses_its_own_kernel_name():
    recipe = subprocess.run(
        ["make", "-n", "-B", "-f", str(ROOT / "Makefile"), ".venv/.ready"], cwd=ROOT, capture_output=True, text=True
    )
    if recipe.returncode != 0:
        pytest.skip(f"make -n failed: {recipe.stderr.strip()}")
    installs = [line for line in recipe.stdout.splitlines() if "ipykernel install" in line]
    assert installs and all(f"--name {kernel.KERNEL['name']}" in line for line in installs), installs
    assert not any("--name python3" in line for line in installs)


def test_kernel_falls_back_on_the_native_one_where_kvlab_is_not_registered(monkeypatch):
    from jupyter_client.kernelspec import KernelSpecManager

    monkeypatch.setattr(KernelSpecManager, "find_kernel_specs", lambda self: {"python3": "/somewhere"})
    assert kernel.kernel_name() == "python3"
    monkeypatch.setattr(KernelSpecManager, "find_kernel_specs", lambda self: {"python3": "/a", "kvlab": "/b"})
    assert kernel.kernel_name() == "kvlab"


def test_stamp_gives_badge_setup_cell_and_kernel_once(tmp_path, capsys):
    from kvlab.notebook.tools import main

    path = tmp_path / "09_new.ipynb"
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# 09 · New\n\nWhat you will learn."),
            nbformat.v4.new_code_cell("tiny = False", metadata={"tags": ["parameters"]}),
        ]
    )
    nbformat.write(nb, path)
    assert main(["stamp", str(path)]) == 0
    stamped = nbformat.read(path, as_version=4)
    assert stamped.cells[0].source.splitlines()[2] == colab.badge("09_new.ipynb")
    assert stamped.cells[1].source == colab.SETUP_CELL and stamped.cells[1].metadata["tags"] == [colab.SETUP_TAG]
    assert stamped.metadata["kernelspec"] == kernel.KERNEL
    first = path.read_bytes()
    assert main(["stamp", str(path)]) == 0 and path.read_bytes() == first, "stamping twice changed the notebook"

    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no title")]), path)
    capsys.readouterr()
    assert main(["stamp", str(path)]) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0, "a bad notebook should cost one line, no traceback"


def test_an_empty_notebook_or_an_empty_error_costs_one_line(tmp_path, capsys, monkeypatch):
    import kvlab.notebook.tools
    from kvlab.notebook.tools import main

    empty = nbformat.v4.new_notebook()
    assert any("badge" in line for line in problems(empty, "x.ipynb"))  # reported, not an IndexError
    path = tmp_path / "empty.ipynb"
    nbformat.write(empty, path)
    assert main(["stamp", str(path)]) == 1
    assert "first cell must be markdown" in capsys.readouterr().err

    def fail(*args, **kwargs):
        raise RuntimeError("")  # a failure with no message at all

    monkeypatch.setattr(kvlab.notebook.tools, "execute", fail)
    assert main(["run", str(path)]) == 1
    assert capsys.readouterr().err.strip() == f"{path}: RuntimeError: (no message)"


def test_kvlab_refusal_shows_only_kvlab_own_refusals():
    from kvlab.notebook.figures.encoder_decoder import kvlab_refusal
    from kvlab.schema import check_choice

    found = kvlab_refusal(lambda: check_choice("cache", "nope", ("dynamic",)))
    assert found.startswith("ValueError from kvlab.schema: ") and "nope" in found
    with pytest.raises(ValueError, match="raised here"):  # a ValueError from outside kvlab is not a refusal
        kvlab_refusal(lambda: int("raised here"))
    with pytest.raises(AssertionError, match="accepted"):
        kvlab_refusal(lambda: None)


def test_timeline_panels_share_a_y_axis_that_fits_the_highest_design():
    """A later panel's higher peak is not clipped by the first panel's range (the notebooks happen to put the
    highest design first)."""
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.meter import MemoryReport, StepMemory
    from kvlab.notebook.figures.torch_cat import plot_timelines

    def report(mib):
        return MemoryReport(
            "cpu",
            "live-storages",
            0,
            0,
            None,
            [StepMemory(i, i * mib * 2**20, (i + 1) * mib * 2**20) for i in range(5)],
        )

    fig = plot_timelines({"low": report(1), "high": report(10)})
    assert all(ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 50 for ax in fig.axes[:2])


def test_a_timeline_panel_whose_peak_is_its_live_line_says_so():
    """Where the peak equals the live line at every step (within 0.5 %), the panel writes so and draws the peak
    above the references; a panel with a transient keeps the thin dashes under them."""
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.meter import MemoryReport, StepMemory
    from kvlab.notebook.figures.torch_cat import plot_timelines

    def report(extra):
        steps = [StepMemory(i, (i + 1) * 2**20, (i + 1 + extra) * 2**20) for i in range(5)]
        return MemoryReport("cpu", "live-storages", 0, 0, None, steps)

    fig = plot_timelines({"same": report(0), "transient": report(1)}, kv_bytes=5 * 2**20)
    same, transient = fig.axes[:2]
    assert [t.get_text() for t in same.texts] == ["peak = live at every step"] and not transient.texts
    peak = {ax: next(line for line in ax.lines if line.get_label() == "peak inside the step") for ax in fig.axes[:2]}
    assert peak[same].get_zorder() > 4 > peak[transient].get_zorder()  # the references are drawn at 4
    labels = fig.legends[0].get_texts()
    assert [t.get_text() for t in labels][-2:] == ["1× final KV", "2× final KV"]


def test_the_holders_figure_splits_the_cache_at_the_peak_and_names_what_it_cannot_draw():
    """Lesson 02's figure: the meter's kv split into the cache from earlier steps and the step's own, the rest by
    category; a holder too small to draw is named under the axis with its size, one that is nowhere is not."""
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.meter import MemoryReport
    from kvlab.notebook.figures.torch_cat import HOLDERS, holders_at_peak, plot_holders

    mib = 2**20
    parts = {"weights": 7 * mib, "kv": 10 * mib, "logits": 2048, "other": mib, "kernels": 0}
    report = MemoryReport("cpu", "cpu-allocator", 7 * mib, 18 * mib + 2048, None, [], parts, None, 4 * mib)
    assert list(holders_at_peak(report).values()) == [4 * mib, 6 * mib, 2048, mib, 0]
    fig, table = plot_holders({"a": report}, kv_bytes=5 * mib)
    assert list(table.columns) == list(HOLDERS) and table.loc["a"].sum() * mib == report.overhead_bytes
    xlabel = fig.axes[0].get_xlabel()
    assert "logits, at most 2 KiB" in xlabel and "kernels" not in xlabel
    assert [t.get_text() for t in fig.legends[0].get_texts()][-3:] == list(HOLDERS)[:2] + ["activations and the rest"]
    with pytest.raises(ValueError, match="track_storages"):
        holders_at_peak(MemoryReport("cuda", "cuda-allocator", 0, mib, mib, [], {"weights": 0}))


def test_stream_modes_with_identical_lines_are_drawn_once_when_asked():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from kvlab.notebook.figures.encoder_decoder import mode_lines

    values = {"hf-static": [1, 2], "reused": [5, 5], "reused-max": [5, 6], "dynamic": [1, 2]}
    df = pd.DataFrame([dict(mode=m, request=i, mib=v) for m, vs in values.items() for i, v in enumerate(vs)])
    _, (every, merged) = plt.subplots(1, 2)
    mode_lines(every, df, x="request", y="mib", legend=False)
    mode_lines(merged, df, x="request", y="mib", legend=False, merge_identical=True)
    assert every.get_legend_handles_labels()[1] == ["hf-static", "reused", "reused-max", "dynamic"]
    assert merged.get_legend_handles_labels()[1] == ["hf-static = dynamic", "reused", "reused-max"]


def test_the_budget_figure_states_which_designs_fit():
    """Lesson 06's title is its message: the designs that fit the memory and those that do not, with their peaks."""
    from kvlab.notebook.figures.will_it_fit import fit_message

    gib = 2**30
    rows = [
        dict(cache="tuple", loop="v4.40", peak_bytes=42.7 * gib, fits=False),
        dict(cache="dynamic", loop="v4.42", peak_bytes=42.7 * gib, fits=False),
        dict(cache="dynamic", loop="v5", peak_bytes=22.6 * gib, fits=True),
    ]
    assert fit_message({"designs": rows, "memory_bytes": 40 * gib}) == (
        "In 40 GiB: dynamic / v5 (22.6 GiB) fits; tuple / v4.40 (42.7 GiB), dynamic / v4.42 (42.7 GiB) do not"
    )
    assert fit_message({"designs": rows[2:], "memory_bytes": 24 * gib}) == "In 24 GiB: dynamic / v5 (22.6 GiB) fits"
    unplanned = [{k: v for k, v in row.items() if k != "fits"} for row in rows]
    assert fit_message({"designs": unplanned, "memory_bytes": None}) == (
        "Predicted peaks from dynamic / v5 (22.6 GiB) to tuple / v4.40 (42.7 GiB)"
    )


LESSONS_CODE_LINES = 3000  # issue 40: the lessons' modules and all they import, in lines


def test_lessons_01_to_03_climb_through_the_lessons_floor_only():
    """What a reader of lessons 01-03 climbs through (their kvlab imports, with what those import in turn, imports
    inside functions included: scripts/lesson_closure.py) holds no module of the planner or the machinery."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lesson_closure", ROOT / "scripts" / "lesson_closure.py")
    closure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(closure)
    lessons = [path for path in NOTEBOOKS if path.name[:2] in ("01", "02", "03")]
    modules = closure.closure(set().union(*(closure.notebook_imports(path) for path in lessons)))
    assert "kvlab.loops" in modules and "kvlab.meter" in modules  # the walk sees through the lessons' imports
    above = ("lab", "planner", "savers", "waste", "explain", "graphs", "encdec", "timing", "compare", "cli", "designs")
    above += ("catalogue", "releases")  # the real models beyond the lessons' presets; the old releases' runner
    assert sorted(m for m in modules if m.split(".")[1:2] and m.split(".")[1] in above) == []
    # issue 40's budget: what a reader climbs through stays a short course's worth of code
    lines = sum(len(closure.module_file(module).read_text().splitlines()) for module in modules)
    assert lines <= LESSONS_CODE_LINES, f"lessons 01-03 climb through {lines:,} lines of kvlab"
    # kvlab's own designs (list, prealloc) and their theory live above the lessons: no module they climb defines them
    moved = {"ListLayer", "PreallocLayer", "WindowLayer", "Buffers", "DesignWalk"}
    defined = {
        (module, node.name)
        for module in modules
        for node in ast.walk(ast.parse(closure.module_file(module).read_text()))
        if isinstance(node, ast.ClassDef) and node.name in moved
    }
    assert defined == set()


def _overhead_rows(ratios: dict, vary: str = "prompt"):
    """A results table with one series over `vary`: `ratios` maps "cache / loop" to {size: overhead ÷ final KV}."""
    import pandas as pd

    held = dict(new=2, batch=1, prompt=300) | {vary: None}
    rows = []
    for design, points in ratios.items():
        cache, loop = design.split(" / ")
        for size, ratio in points.items():
            kv = 1000 * size
            point = dict(held, **{vary: size}, cache=cache, loop=loop, preset="p", dtype="float32", device="cpu")
            rows.append(point | dict(status="ok", kv_final_bytes=kv, overhead_bytes=ratio * kv))
    table = pd.DataFrame(rows)
    return table.assign(predicted_overhead_bytes=table["overhead_bytes"])


def test_the_overhead_figure_names_its_only_mover_and_leaves_one_point_designs_out():
    """Appendix A5's figures: where one design moves with the size and the others hold, the title names that one
    with its two ends; a design measured at one point of the series is not drawn but named, with its ratio, by
    `one_point_note`; the mover is then the title's one message."""
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.notebook.figures.compare import one_point_note, overhead_figure

    table = _overhead_rows(
        {
            "tuple / v4.40": {100: 2.21, 1600: 2.24},
            "dynamic / v4.42": {100: 1.36, 1600: 1.38},
            "prealloc / v5": {100: 1.44, 1600: 1.19},
            "dynamic / v5": {100: 1.17, 1600: 1.19},
            "static / v5": {100: 1.18, 1600: 1.19},
            "list / v5": {100: 1.05},
        }
    )
    fig = overhead_figure(table, "prompt")
    title = fig.texts[0].get_text()
    assert title.split("\n")[0] == (
        "Only prealloc / v5's peak ÷ final KV moves with prompt length: 1.44× at 100 → 1.19× at 1600"
        " (the others within 0.03×)"
    ), title
    assert "at prompt length 1600" not in title  # no second message: the levels at the largest size
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert not any("list" in label for label in labels)
    assert "static / v5 (on dynamic / v5's line)" in labels  # within 0.01x at every point: one hides the other
    assert "prealloc / v5" in labels  # 0.25x from the others at 100 tokens: a line of its own
    assert all(ax.get_xscale() == "log" for ax in fig.axes)  # 100 to 1600: a factor of 16
    today = overhead_figure(table, "prompt", today_only=True)
    assert [ax.get_title() for ax in today.axes] == ["today's loop (v5), every design (y zoomed)"]
    # the same mover; the others are today's designs alone, which move by 0.02x (tuple / v4.40: 0.03x)
    assert today.texts[0].get_text().split("\n")[0] == title.split("\n")[0].replace("0.03×", "0.02×")
    assert one_point_note(table, "prompt") == (
        "Measured at one point of the series only, so not drawn: list / v5 1.05× at prompt length 100"
    )
    assert one_point_note(table[table["cache"] != "list"], "prompt") == ""


def test_the_overhead_title_does_not_name_one_mover_where_several_move():
    """Two designs that move by more than a level's gap each way: no design is called the only mover."""
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.notebook.figures.compare import overhead_figure

    table = _overhead_rows({"dynamic / v5": {100: 1.5, 1600: 1.2}, "static / v5": {100: 1.1, 1600: 1.3}})
    title = overhead_figure(table, "prompt").texts[0].get_text()
    assert title.startswith(
        "Peak above the weights ÷ final KV rises for some designs and falls for others with prompt length; most: "
        "dynamic / v5, 1.50× at 100 → 1.20× at 1600\n"
    ), title


def test_the_beam_figure_title_gives_each_ratio_to_two_decimals_on_two_lines():
    """Appendix A6's beam figure: the message over two lines of at most 100 characters, each design's ratio to 2
    decimals (the lessons'), one cache object's two ratios named by loop where they differ at 2 decimals."""
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.meter import MemoryReport, StepMemory
    from kvlab.notebook.figures.strategies import BEAM_PANELS, beam_figure

    report = MemoryReport("cpu", "live-storages", 0, 0, None, [StepMemory(i, i, i + 1) for i in range(3)])
    reports = dict.fromkeys(BEAM_PANELS, report)
    overheads = {"tuple/v4.40": 2.996, "tuple/v4.42": 2.004, "dynamic/v4.40": 1.012, "dynamic/v4.42": 1.018}
    title = beam_figure(reports, overheads, 2, "setup").texts[0].get_text().split("\n")
    assert title == [
        "Peak above the weights in beam search: the tuple 3.00× the final KV under ≤ 4.41's loop,",
        "2.00× under 4.42's; one cache object 1.01× under ≤ 4.41's, 1.02× under 4.42's",
        "setup",
    ]
    assert all(len(line) <= 100 for line in title)
    same = beam_figure(reports, overheads | {"dynamic/v4.40": 1.021}, 2, "s").texts[0].get_text()
    assert "one cache object 1.02× under either\n" in same
    with pytest.raises(ValueError, match="tuple/v4.42"):
        beam_figure({k: v for k, v in reports.items() if k != "tuple/v4.42"}, overheads, 2, "s")
