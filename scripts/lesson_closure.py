"""The kvlab modules a reader of the given notebooks climbs through: those the notebooks import, with everything
those import in turn (imports inside functions too, and the packages above each module), in lines.

    python scripts/lesson_closure.py notebooks/01_*.ipynb notebooks/02_*.ipynb notebooks/03_*.ipynb
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imported(tree: ast.AST, package: str) -> set[str]:
    """kvlab modules named by the import statements of `tree` (`package`: where relative imports start)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in names if name.split(".")[0] == "kvlab" and module_file(name)}


def imports_of(module: str) -> set[str]:
    path = module_file(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return _imported(ast.parse(path.read_text()), package)


def notebook_imports(notebook: Path) -> set[str]:
    cells = json.loads(notebook.read_text())["cells"]
    source = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    # IPython's magics and shell lines are not Python
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    return _imported(ast.parse(source), "")


def closure(roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [module.rsplit(".", depth)[0] for depth in range(1, module.count(".") + 1)]
        todo += parents + sorted(imports_of(module))
    return seen


def main(notebooks: list[str]) -> None:
    if not notebooks:
        sys.exit("usage: python scripts/lesson_closure.py NOTEBOOK.ipynb ...")
    modules = closure(set().union(*(notebook_imports(Path(name)) for name in notebooks)))
    lines = {module: len(module_file(module).read_text().splitlines()) for module in modules}
    for module in sorted(lines):
        print(f"{lines[module]:6,d}  {module}")
    print(f"{sum(lines.values()):6,d}  lines in {len(lines)} modules")


if __name__ == "__main__":
    main(sys.argv[1:])
