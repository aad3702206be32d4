"""Notebook tooling: stamp (badge, setup cell, kernel), execute with papermill, clean, check.

    python -m kvlab.notebook stamp notebooks/*.ipynb      # badge + Colab setup cell + kernelspec, from kvlab.notebook.colab
    python -m kvlab.notebook run notebooks/04_analysis.ipynb   # execute in place with its defaults, clean, check
    python -m kvlab.notebook run NB -o /tmp/x.ipynb -p tiny True   # a trial run elsewhere, parameters overridden
    python -m kvlab.notebook check notebooks/*.ipynb      # what a committed notebook must not carry

`run` stamps first, executes from the notebook's folder (relative paths such as ../data resolve) on the
`kvlab` kernel where `make lab` registered it (else the native one), then strips what only adds diff noise:
papermill's metadata and per-cell timestamps. It does not rewrite outputs: warnings, machine paths and
errors are reported by `check` and must be fixed in the notebook or in kvlab.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import nbformat

from .colab import KERNEL, QUIET_KERNEL, SETUP_TAG, SETUP_CELL, badge, kernel_name

ROOT = Path(__file__).resolve().parents[2]
BADGE_LINE = re.compile(r"^.*colab-badge.*$\n?", re.MULTILINE)
# What an output must not show: the machine it ran on (home, checkout, environment, temporary files).
MACHINE_PATHS = re.compile("|".join(re.escape(p) for p in sorted({str(ROOT), sys.prefix}, key=len,
                                                                  reverse=True))
                           + r"|/home/\w|/root/|/tmp/|/content/|site-packages|[A-Z]:\\\\Users")
WARNING = re.compile(r"\w*Warning\b|^warning:", re.IGNORECASE | re.MULTILINE)


# -- stamping -------------------------------------------------------------------------------------------
def is_setup_cell(cell) -> bool:
    return cell.cell_type == "code" and (SETUP_TAG in cell.metadata.get("tags", [])
                                         or "google.colab" in cell.source)


def stamp(nb, name: str):
    """Give `nb` (notebooks/<name>) the badge under its title, the setup cell as its first code cell, the
    kvlab kernelspec. Idempotent: a stamped notebook is left as it is."""
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "markdown" or not first.source.startswith("# "):
        raise ValueError(f"{name}: the first cell must be markdown starting with a '# ' title")
    title, _, rest = BADGE_LINE.sub("", first.source).partition("\n")
    first.source = f"{title}\n\n{badge(name)}\n\n{rest.lstrip(chr(10))}".rstrip("\n")
    setup = [i for i, cell in enumerate(nb.cells) if is_setup_cell(cell)]
    for i in reversed(setup[1:]):
        del nb.cells[i]
    if setup:
        cell = nb.cells[setup[0]]
    else:
        first_code = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells))
        cell = nbformat.v4.new_code_cell()
        nb.cells.insert(first_code, cell)
    if cell.source != SETUP_CELL:
        cell.source, cell.outputs, cell.execution_count = SETUP_CELL, [], None
    cell.metadata["tags"] = [SETUP_TAG]
    nb.metadata["kernelspec"] = dict(KERNEL)
    return nb


# -- cleaning and checking -----------------------------------------------------------------------------
def clean(nb):
    """Drop what changes on every run without meaning anything: papermill's metadata, timestamps."""
    nb.metadata.pop("papermill", None)
    nb.metadata["kernelspec"] = dict(KERNEL)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        if cell.metadata.get("tags") == []:
            del cell.metadata["tags"]
    return nb


def output_text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    data = output.get("data", {})
    return "\n".join(str(data[k]) for k in ("text/plain", "text/html", "text/markdown") if k in data)


def parameters_cells(nb) -> list[int]:
    return [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]


def declared_parameters(nb) -> set[str]:
    """Names assigned in the `parameters` cell (parsed with ast)."""
    names = set()
    for i in parameters_cells(nb):
        for node in ast.walk(ast.parse(nb.cells[i].source)):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def problems(nb, name: str) -> list[str]:
    """Everything that keeps a committed notebook from being presentable, one line each."""
    found = []
    if nb.metadata.get("kernelspec") != KERNEL:
        found.append(f"kernelspec {nb.metadata.get('kernelspec')} is not {KERNEL}")
    if "papermill" in nb.metadata:
        found.append("papermill metadata in the notebook")
    if len(parameters_cells(nb)) != 1:
        found.append(f"cells tagged 'parameters': {parameters_cells(nb)}; exactly one is needed")
    if "tiny" not in declared_parameters(nb):
        found.append("no `tiny` parameter (the test suite's quick run sets tiny=True)")
    if not nb.cells or badge(name) not in nb.cells[0].source:
        found.append("the first cell lacks the badge from kvlab.notebook.colab (run `stamp`)")
    if [cell.source for cell in nb.cells if is_setup_cell(cell)] != [SETUP_CELL]:
        found.append("the setup cell differs from kvlab.notebook.colab.SETUP_CELL (run `stamp`)")
    for i, cell in enumerate(nb.cells):
        if "papermill" in cell.metadata or "execution" in cell.metadata:
            found.append(f"cell {i}: per-cell papermill metadata or execution timestamps")
        if "injected-parameters" in cell.metadata.get("tags", []):
            found.append(f"cell {i}: papermill's injected parameters (commit a run with the defaults)")
        if cell.cell_type != "code":
            continue
        if cell.get("execution_count") is None and not is_setup_cell(cell):
            found.append(f"cell {i}: never executed")
        for output in cell.get("outputs", []):
            text = output_text(output)
            if output.get("output_type") == "error":
                found.append(f"cell {i}: error output {output.get('ename')}: {output.get('evalue')}")
            elif output.get("name") == "stderr" and WARNING.search(text):
                found.append(f"cell {i}: a warning in the output: {WARNING.search(text).group(0)}")
            if MACHINE_PATHS.search(text):
                found.append(f"cell {i}: a machine path in the output: {MACHINE_PATHS.search(text).group(0)}")
    return found


# -- execution -----------------------------------------------------------------------------------------
def execute(path: Path, output: Path | None = None, parameters: dict | None = None, kernel: str | None = None):
    """Stamp, execute with papermill from the notebook's folder, clean; write to `output` (default: in place)."""
    import papermill

    path, output = Path(path), Path(output or path)
    nb = stamp(nbformat.read(path, as_version=4), path.name)
    nbformat.write(nb, output)
    papermill.execute_notebook(str(output), str(output), parameters=parameters or {},
                               kernel_name=kernel or kernel_name(), cwd=str(path.resolve().parent),
                               progress_bar=False, log_output=False, extra_arguments=QUIET_KERNEL)
    nb = clean(nbformat.read(output, as_version=4))
    nbformat.write(nb, output)
    return nb


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.notebook", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("stamp", "run", "check"))
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, help="run: write the executed copy here (one notebook)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="run: override a parameter (a Python literal or a string)")
    parser.add_argument("-k", "--kernel", help=f"run: kernel name (default: {KERNEL['name']} if registered, "
                                               "else the native python3)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    if args.output and len(args.notebooks) != 1:
        parser.error("--output takes one notebook")
    if (args.parameter or args.output) and args.command != "run":
        parser.error("--output and --parameter belong to `run`")
    if args.parameter and not args.output:
        parser.error("overridden parameters would be committed: give --output for a trial run")
    failed = 0
    for path in args.notebooks:
        if args.command == "stamp":
            try:
                nbformat.write(stamp(nbformat.read(path, as_version=4), path.name), path)
            except ValueError as error:  # no '# ' title to put the badge under
                print(error, file=sys.stderr)
                failed += 1
                continue
            print(f"stamped {path}")
            continue
        if args.command == "run":
            try:
                nb = execute(path, args.output, {k: _value(v) for k, v in args.parameter}, args.kernel)
            except Exception as error:  # papermill's PapermillExecutionError names the failing cell
                last_line = (str(error).strip().splitlines() or ["(no message)"])[-1]
                print(f"{path}: {type(error).__name__}: {last_line}", file=sys.stderr)
                failed += 1
                continue
        else:
            nb = nbformat.read(path, as_version=4)
        found = problems(nb, path.name)
        failed += bool(found)
        print(f"{args.output or path}: " + ("clean" if not found else f"{len(found)} problem(s)"))
        for line in found:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
