"""Where a record was measured: the device's name, the versions and the commit, the time."""

from __future__ import annotations

import datetime
import functools
import platform
import subprocess
from pathlib import Path

import torch
import transformers

from .. import __version__
from ..models import device_name


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(device: str) -> dict:
    return dict(
        device_name=device_name(device),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        kvlab_version=__version__,
        python_version=platform.python_version(),
        git_commit=git_commit(),
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
