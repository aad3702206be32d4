"""Every notebook executes with tiny parameters on CPU, and every committed notebook is presentable.

(a) Execution: each notebooks/*.ipynb runs top to bottom under papermill with the tiny parameter
    overrides below (for a notebook not listed: its own defaults, or `tiny=True` where its
    `parameters` cell defines such a switch). The executed copy goes to a tmp dir; the kernel's
    working directory is notebooks/, as in Jupyter, so relative data paths resolve.
(b) Committed state: outputs present, no error outputs, exactly one `parameters`-tagged cell, and an
    "Open in Colab" badge that links to the notebook's own file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
COLAB_PREFIX = "https://colab.research.google.com/github/kvlab/kvlab/blob/main/notebooks/"

# Tiny sizes per notebook (file stem): seconds each on a 2-core CPU. Unlisted notebooks run with
# their own defaults unless they define one of TINY_SWITCHES.
TINY: dict[str, dict] = {
    "01_torch_cat_copies": dict(device="cpu", width=64, rows=256, layers=4, steps=6, lengths=[4, 8, 16]),
    "02_tuple_vs_dynamic": dict(device="cpu", preset="toy", dtype="float32", batch=1, prompt=8, new=5,
                                leak_preset="toy", leak_overrides="vocab_size=2000", leak_batch=1, leak_prompt=16,
                                leak_new=3, check_batch=1, check_prompt=4, check_new=3),
    "03_experiment_point": dict(device="cpu", preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=8,
                                new=4),
    "05_strategies_and_restart": dict(device="cpu", preset="toy", dtype="float32", batch=1, prompt=8, new=5,
                                      num_beams=2, restart_new=3, check_new=3),
}
TINY_SWITCHES = ("tiny", "smoke", "quick", "smoke_test")
# Parameters that name a file or folder the notebook writes: pointed into the tmp dir.
OUTPUT_PARAMETERS = ("record_path", "out", "out_dir", "output_dir", "output_path")


def _ids(paths):
    return [path.stem for path in paths]


def declared_parameters(path: Path) -> set[str]:
    """Names assigned in the notebook's `parameters` cell (parsed with ast, not papermill's regex)."""
    nb = nbformat.read(path, as_version=4)
    names = set()
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            for node in ast.walk(ast.parse(cell.source)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def tiny_parameters(path: Path, tmp_path: Path) -> dict:
    declared = declared_parameters(path)
    parameters = dict(TINY.get(path.stem, {}))
    for name in TINY_SWITCHES:
        if name in declared and name not in parameters:
            parameters[name] = True
    for name in OUTPUT_PARAMETERS:
        if name in declared and name not in parameters:
            parameters[name] = str(tmp_path / f"{name}.out")
    unknown = set(parameters) - set(declared)
    assert not unknown, f"{path.name} has no parameter(s) {sorted(unknown)}; its parameters: {sorted(declared)}"
    return parameters


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_executes_with_tiny_parameters(path, tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    # The tiny models gain nothing from threads, and on a shared 2-core machine OpenMP threads
    # spinning against other processes make each matmul up to 100x slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # tiny means CPU, even on a GPU machine
    output = tmp_path / path.name
    papermill.execute_notebook(str(path), str(output), parameters=tiny_parameters(path, tmp_path),
                               kernel_name="python3", cwd=str(path.parent), progress_bar=False,
                               log_output=False)
    executed = nbformat.read(output, as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_notebook_is_executed_and_clean(path):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    unexecuted = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.get("execution_count") is None]
    assert not unexecuted, f"{path.name}: code cells {unexecuted} were never executed; commit the executed notebook"
    assert any(cell.get("outputs") for cell in code), f"{path.name} has no outputs; commit the executed notebook"
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", (
                f"{path.name} cell {i} has an error output: {output.get('ename')}: {output.get('evalue')}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_exactly_one_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: cells tagged 'parameters': {tagged}; papermill needs exactly one"
    assert nb.cells[tagged[0]].cell_type == "code"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_colab_badge_points_at_its_own_file(path):
    nb = nbformat.read(path, as_version=4)
    markdown = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")
    assert "open in colab" in markdown.lower() and "colab-badge" in markdown, (
        f"{path.name} has no 'Open in Colab' badge")
    links = re.findall(r"https://colab\.research\.google\.com/github/[^\s)\"'>]+", markdown)
    assert links, f"{path.name}: the Colab badge has no link to a notebook on GitHub"
    assert all(link == COLAB_PREFIX + path.name for link in links), (
        f"{path.name}: Colab links {links} should all be {COLAB_PREFIX + path.name}")
