"""A file named on the command line: a path, or the name of one shipped with kvlab (kvlab/lab/sweeps)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml


def shipped_or_path(name: str | os.PathLike, folder: Path, what: str) -> Path:
    """`name` if it exists, else, for a bare name (no folder in it), `folder/<stem>.yaml`; else a one-line error
    listing what `folder` ships. A path into a folder is never swapped for the shipped file of the same name."""
    bare = Path(name).parent == Path(".")
    for path in (Path(name), *([folder / f"{Path(name).stem}.yaml"] if bare else [])):
        if path.exists():
            return path
    if not bare:
        raise ValueError(f"{what} file {str(name)!r} not found (no such file); give an existing path")
    choices = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise ValueError(f"{what} file {str(name)!r} not found; give a path or one of: {choices}")


def read_yaml(path: Path, what: str):
    """The content of a sweep file; a folder, or a file that cannot be read or is not YAML, is one
    line naming it."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a {what} file (YAML)")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}: {error.problem})" if mark else ""
        raise ValueError(f"{path} is not valid YAML{where}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file; give a {what} file (YAML)") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None
