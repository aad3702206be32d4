"""Notebook tooling (`python -m kvlab.notebook`): stamp (badge, setup cell, kernel), run with papermill, clean, check.

Usage and rules: notebooks/README.md. Outputs are never rewritten: a warning or machine path is fixed at its source.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import stat
import sys
from pathlib import Path

import nbformat

from ..lab.kernel import KERNEL, QUIET_KERNEL, kernel_name
from ..lab.store import create_exclusive
from .colab import SETUP_CELL, SETUP_TAG, badge

ROOT = Path(__file__).resolve().parents[2]
BADGE_LINE = re.compile(r"^.*colab-badge.*$\n?", re.MULTILINE)
# What an output must not show: the machine it ran on (home, checkout, environment, temporary files).
MACHINE_PATHS = re.compile(
    "|".join(re.escape(p) for p in sorted({str(ROOT), sys.prefix}, key=len, reverse=True))
    + r"|/home/\w|/root/|/tmp/|/content/|site-packages|[A-Z]:\\\\Users"
)
WARNING = re.compile(r"\w*Warning\b|^warning:", re.IGNORECASE | re.MULTILINE)
# A lesson (01-06, not an appendix) is read in one sitting: its prose is at most this many words, and the six
# together at most LESSONS_WORDS; longer material goes to an appendix (notebooks/README.md).
LESSON_WORDS, LESSONS_WORDS = 1500, 5300
TABLE_ROWS = 12  # the most rows a lesson's table shows
FENCE = re.compile(r"```.*?```", re.DOTALL)
HTML_ROW = re.compile(r"<tr\b")


def is_lesson(name: str) -> bool:
    return name[:1].isdigit()


def prose_words(nb) -> int:
    """Words of prose: markdown cells without the badge line, fenced code blocks or markup-only tokens."""
    text = " ".join(FENCE.sub(" ", BADGE_LINE.sub("", c.source)) for c in nb.cells if c.cell_type == "markdown")
    return sum(1 for token in text.split() if re.search(r"\w", token))


def is_setup_cell(cell) -> bool:
    return cell.cell_type == "code" and (SETUP_TAG in cell.metadata.get("tags", []) or "google.colab" in cell.source)


def stamp(nb, name: str):
    """Give `nb` (notebooks/<name>) the badge under its title, the setup cell as its first code cell, the
    kvlab kernelspec. Idempotent: a stamped notebook is left as it is."""
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "markdown" or not first.source.startswith("# "):
        raise ValueError(f"{name}: the first cell must be markdown starting with a '# ' title")
    title, _, rest = BADGE_LINE.sub("", first.source).partition("\n")
    first.source = f"{title}\n\n{badge(name)}\n\n{rest.lstrip(chr(10))}".rstrip("\n")
    setup = [i for i, cell in enumerate(nb.cells) if is_setup_cell(cell)]
    nb.cells = [cell for i, cell in enumerate(nb.cells) if i not in setup[1:]]
    if not setup:
        setup = [next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells))]
        nb.cells.insert(setup[0], nbformat.v4.new_code_cell())
    cell = nb.cells[setup[0]]
    if cell.source != SETUP_CELL:
        cell.source, cell.outputs, cell.execution_count = SETUP_CELL, [], None
    cell.metadata["tags"] = [SETUP_TAG]
    nb.metadata["kernelspec"] = dict(KERNEL)
    return nb


def clean(nb):
    """Drop what changes on every run without meaning anything: papermill's metadata, timestamps. Our own:
    nbconvert's ClearMetadataPreprocessor leaves markdown cells alone, where papermill writes too."""
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
    """Names assigned in the `parameters` cell (ast: papermill infers them from a notebook's path only)."""
    names = set()
    for i in parameters_cells(nb):
        for node in ast.walk(ast.parse(nb.cells[i].source)):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else ([node.target] if isinstance(node, ast.AnnAssign) else [])
            )
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def problems(nb, name: str) -> list[str]:
    """Everything that keeps a committed notebook from being presentable, one line each."""
    kernel, parameters = nb.metadata.get("kernelspec"), parameters_cells(nb)
    checks = [
        (kernel != KERNEL, f"kernelspec {kernel} is not {KERNEL}"),
        ("papermill" in nb.metadata, "papermill metadata in the notebook"),
        (len(parameters) != 1, f"cells tagged 'parameters': {parameters}; exactly one is needed"),
        ("tiny" not in declared_parameters(nb), "no `tiny` parameter (the test suite runs with tiny=True)"),
        (
            not nb.cells or badge(name) not in nb.cells[0].source,
            "the first cell lacks the badge from kvlab.notebook.colab (run `stamp`)",
        ),
        (
            [cell.source for cell in nb.cells if is_setup_cell(cell)] != [SETUP_CELL],
            "the setup cell differs from kvlab.notebook.colab.SETUP_CELL (run `stamp`)",
        ),
    ]
    found = [message for failed, message in checks if failed] + order_problems(nb)
    if is_lesson(name) and (words := prose_words(nb)) > LESSON_WORDS:
        found.append(f"{words} words of prose; a lesson has at most {LESSON_WORDS} (move depth to an appendix)")
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
            found += [f"cell {i}: {message}" for message in table_problems(output, is_lesson(name))]
    return found


def order_problems(nb) -> list[str]:
    """One cell order in every notebook: the title (and what you learn), the Colab setup cell, a '## Parameters'
    markdown cell, the parameters cell."""
    kinds = [
        (0, lambda c: c.cell_type == "markdown" and c.source.startswith("# "), "the '# ' title"),
        (1, is_setup_cell, "the Colab setup cell"),
        (2, lambda c: c.cell_type == "markdown" and c.source.startswith("## Parameters"), "'## Parameters' prose"),
        (3, lambda c: "parameters" in c.metadata.get("tags", []), "the parameters cell"),
    ]
    return [
        f"cell {i} should be {what} (order: title, Colab setup, '## Parameters', parameters)"
        for i, fits, what in kinds
        if len(nb.cells) <= i or not fits(nb.cells[i])
    ]


def table_problems(output, lesson: bool) -> list[str]:
    """A shown table is whole: no cell cut short with '…' (pandas' max_colwidth), at most TABLE_ROWS rows in
    a lesson."""
    html = output.get("data", {}).get("text/html", "") if output.get("output_type") != "stream" else ""
    text = output_text(output)
    found = ["a table cell cut short ('…')"] if "…" in html or re.search(r"\S\.\.\.(\s|$)", html) else []
    rows = len(HTML_ROW.findall(html)) - 1  # the header row
    if lesson and rows > TABLE_ROWS:
        found.append(f"a table of {rows} rows; a lesson shows at most {TABLE_ROWS}")
    if "…" in text and "<table" not in html and output.get("output_type") == "execute_result":
        found.append("an output cut short ('…')")
    return found


def execute(path: Path, output: Path | None = None, parameters: dict | None = None, kernel: str | None = None):
    """Stamp, execute with papermill from the notebook's folder, clean; write to `output` (default: in place) only
    once the run has succeeded: it runs in a temporary copy beside `output`, which then replaces `output` at once,
    so a failed run (a missing kernel, a failing cell, Ctrl-C) leaves `output` byte for byte as it was."""
    import papermill

    path, output = Path(path), Path(output or path)
    copy = temporary_copy(output)
    try:
        nbformat.write(stamp(nbformat.read(path, as_version=4), path.name), copy)
        nb = papermill.execute_notebook(
            str(copy),
            str(copy),
            parameters=parameters or {},
            kernel_name=kernel or kernel_name(),
            cwd=str(path.resolve().parent),
            progress_bar=False,
            log_output=False,
            extra_arguments=QUIET_KERNEL,
        )
        nbformat.write(clean(nb), copy)
        os.replace(copy, output)  # replaces a link at `output` itself, never the file it points to
    finally:
        copy.unlink(missing_ok=True)
    return nb


def temporary_copy(output: Path) -> Path:
    """A new file beside `output`, this run's alone (O_EXCL), with the mode `output` has (or the umask's)."""
    descriptor, copy = create_exclusive(output.parent, output.name, ".ipynb")
    os.close(descriptor)
    if output.is_file():
        os.chmod(copy, stat.S_IMODE(output.stat().st_mode))
    return copy


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
    parser.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="run: override a parameter (a Python literal or a string)",
    )
    parser.add_argument(
        "-k", "--kernel", help=f"run: kernel name (default: {KERNEL['name']} if registered, else the native python3)"
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    for wrong, message in (
        (missing, f"no such notebook: {', '.join(missing)}"),
        (args.output and len(args.notebooks) != 1, "--output takes one notebook"),
        ((args.parameter or args.output) and args.command != "run", "--output and --parameter belong to `run`"),
        (args.parameter and not args.output, "overridden parameters would be committed: give --output for a trial run"),
    ):
        if wrong:
            parser.error(message)
    failed = 0
    for path in args.notebooks:
        try:
            if args.command == "stamp":
                nbformat.write(stamp(nbformat.read(path, as_version=4), path.name), path)
            elif args.command == "run":
                nb = execute(path, args.output, {k: _value(v) for k, v in args.parameter}, args.kernel)
            else:
                nb = nbformat.read(path, as_version=4)
        except Exception as error:  # stamp: no '# ' title; run: papermill's error names the failing cell
            print(
                f"{path}: {type(error).__name__}: {(str(error).strip().splitlines() or ['(no message)'])[-1]}",
                file=sys.stderr,
            )
            failed += 1
            continue
        if args.command == "stamp":
            print(f"stamped {path}")
            continue
        found = problems(nb, path.name)
        if args.parameter:  # a trial run (-o) shows the parameters it was given: that is its point, not a problem
            found = [line for line in found if "papermill's injected parameters" not in line]
        failed += bool(found)
        print(f"{args.output or path}: " + ("clean" if not found else f"{len(found)} problem(s)"))
        for line in found:
            print(f"  {line}")
    return 1 if failed else 0
