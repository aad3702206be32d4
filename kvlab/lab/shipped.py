"""A file named on the command line: a path, or the name of one shipped with kvlab (kvlab/lab/sweeps, streams)."""

from __future__ import annotations

import os
from pathlib import Path


def shipped_or_path(name: str | os.PathLike, folder: Path, what: str) -> Path:
    """`name` if it exists, else `folder/<stem>.yaml`; else a one-line error listing what `folder` ships."""
    path = Path(name)
    if path.exists():
        return path
    shipped = folder / f"{path.stem}.yaml"
    if shipped.exists():
        return shipped
    choices = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise ValueError(f"{what} file {str(name)!r} not found; give a path or one of: {choices}")
