"""Colab, emulated: every notebook runs from its setup cell in a fresh environment that has only what Colab
ships and kvlab relies on (torch, ipykernel, git), with a fake `google.colab` imported at kernel start.

The setup cell must clone the repository (pointed here at this checkout's committed state through
KVLAB_REPOSITORY), install kvlab and its runtime dependencies without touching torch or pulling JupyterLab,
and move into notebooks/ so that ../data resolves. Notebook 02 then runs whole with tiny=True (it also installs
the real transformers 4.40.1 and 4.42.4 beside Colab's, for its reference points); every other notebook's setup
cell and every import of its code cells run there, one notebook after another in one kernel (each runs whole, tiny,
in tests/test_notebooks.py). A few minutes: installing torch and kvlab's dependencies into the fresh environment
dominates.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill
import pytest

from kvlab.lab.kernel import QUIET_KERNEL
from kvlab.notebook.colab import SETUP_TAG
from kvlab.notebook.tools import declared_parameters, is_setup_cell

ROOT = Path(__file__).resolve().parents[2]
# not the hidden file `kvlab.notebook run` writes beside a notebook while it executes it
NOTEBOOKS = sorted(path for path in (ROOT / "notebooks").glob("*.ipynb") if not path.name.startswith("."))
# Colab's kernel has google.colab imported before the first cell; this one does the same.
KERNEL_START = "import google.colab; from ipykernel.kernelapp import launch_new_instance; launch_new_instance()"
RUN_WHOLE = {"02_tuple_vs_dynamic"}  # the notebook that installs the real releases in Colab (kvlab.lab.reference)


def setup_and_imports(nb):
    """`nb` cut to its setup cell and one cell with every import of its code cells (shell and magic lines aside)."""
    imports = []
    for cell in nb.cells:
        if cell.cell_type == "code" and not is_setup_cell(cell):
            source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("!", "%")))
            imports += [
                ast.unparse(node)
                for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.Import, ast.ImportFrom))
            ]
    setup = next(cell for cell in nb.cells if is_setup_cell(cell))
    check = "import os\nassert os.path.isdir('../data'), os.getcwd()"
    nb.cells = [setup, nbformat.v4.new_code_cell("\n".join(dict.fromkeys(imports))), nbformat.v4.new_code_cell(check)]
    return nb


def run(*command, cwd=None):
    """A command in the fresh environment, away from this checkout (whose kvlab/ would shadow the installed one)."""
    return subprocess.run(
        [str(c) for c in command], check=True, capture_output=True, text=True, cwd=cwd or Path(command[0]).parent
    )


@pytest.fixture(scope="session")
def colab(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout (the setup cell clones the repository)")
    base = tmp_path_factory.mktemp("colab")
    venv = base / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    # What Colab ships that kvlab relies on; the same torch release as the project's (pip's cache, or a local wheel).
    from importlib.metadata import version

    run(python, "-m", "pip", "install", "--quiet", f"torch=={version('torch')}", "ipykernel")
    torch_before = run(
        python, "-c", "import torch, os; print(torch.__version__, os.path.getmtime(torch.__file__))"
    ).stdout

    fake = base / "fake"
    (fake / "google" / "colab").mkdir(parents=True)
    (fake / "google" / "__init__.py").write_text("")
    (fake / "google" / "colab" / "__init__.py").write_text(
        '"""Stands in for Colab\'s module in tests/infra/test_colab.py."""\n'
    )
    kernel_dir = base / "jupyter" / "kernels" / "colab"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [str(python), "-c", KERNEL_START, "-f", "{connection_file}"],
                "display_name": "Colab (emulated)",
                "language": "python",
                "env": {"PYTHONPATH": str(fake)},
            }
        )
    )
    content = base / "content"  # Colab's working directory
    content.mkdir()
    yield dict(python=python, content=content, jupyter=base / "jupyter", torch_before=torch_before)


# The notebook that installs the real releases runs whole; every other one's setup cell and imports, all in one
# kernel (one kernel's start and imports, not eight: the setup cells are one generated cell, and after the first
# has cloned and installed, each finds the repository in place).
@pytest.mark.slow
@pytest.mark.parametrize(
    "paths",
    [[p] for p in NOTEBOOKS if p.stem in RUN_WHOLE] + [[p for p in NOTEBOOKS if p.stem not in RUN_WHOLE]],
    ids=[p.stem for p in NOTEBOOKS if p.stem in RUN_WHOLE] + ["setup-and-imports-of-the-others"],
)
def test_notebook_runs_in_emulated_colab(paths, colab, monkeypatch):
    monkeypatch.setenv("KVLAB_REPOSITORY", f"file://{ROOT}")
    monkeypatch.setenv("JUPYTER_PATH", str(colab["jupyter"]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # nothing of this checkout on the kernel's path
    cells = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[[i for i, c in enumerate(nb.cells) if c.cell_type == "code"][0]].metadata.get("tags") == [
            SETUP_TAG
        ], f"{path.name}: the Colab setup cell must be the first code cell"
        if path.stem not in RUN_WHOLE:
            cells += setup_and_imports(nb).cells  # (setup_and_imports cuts nb itself)
    if paths[0].stem in RUN_WHOLE:
        source, parameters = paths[0], {"tiny": True} if "tiny" in declared_parameters(nb) else {}
    else:
        source, parameters = colab["content"].parent / "setup-and-imports.ipynb", {}
        nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata), source)
    output = colab["content"] / f"executed-{source.name}"
    # papermill raises at a failing cell, naming it (and so its notebook) in its message
    papermill.execute_notebook(
        str(source),
        str(output),
        parameters=parameters,
        kernel_name="colab",
        cwd=str(colab["content"]),
        progress_bar=False,
        log_output=False,
        extra_arguments=QUIET_KERNEL,
    )
    executed = nbformat.read(output, as_version=4)
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{source.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"

    python = colab["python"]
    where = run(python, "-c", "import kvlab; print(kvlab.__file__)").stdout
    assert str(python.parent.parent) in where, f"kvlab was not installed into the environment: {where}"
    assert (colab["content"] / "kvlab" / "data").is_dir(), "the setup cell did not fetch the repository's data"
    assert (
        run(python, "-c", "import torch, os; print(torch.__version__, os.path.getmtime(torch.__file__))").stdout
        == colab["torch_before"]
    ), "the setup cell reinstalled Colab's torch"
    lab = subprocess.run([str(python), "-m", "pip", "show", "--quiet", "jupyterlab"], capture_output=True)
    assert lab.returncode != 0, "the setup cell installed JupyterLab, which no notebook needs at runtime"
