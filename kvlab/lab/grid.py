"""What a sweep runs: grid items and sweep files → points, validated, each with a stable id.

A sweep file (YAML) has `fixed:` parameters shared by every point and `grid:` lists whose product gives the
points; a grid entry whose values are mappings sets several parameters together, e.g. `design: [{cache: tuple,
loop: v4.40}, {cache: dynamic, loop: v5}]`. Optional: `description:`, and `point_timeout_s:`, the seconds a cell
of a point's notebook may run before the point is a failure row.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path

import torch

from ..configs import parse_value
from ..planner.params import normalize
from ..schema import DEFAULTS, is_true
from .shipped import read_yaml, shipped_or_path

SWEEPS_DIR = Path(__file__).resolve().parent / "sweeps"
# Parameters added after results were first stored: left out of a point's id at their defaults, so those
# results keep their ids (a rerun still skips them, data/ stays joinable).
LATER_PARAMETERS = ("kind", "runtime", "restart_from")


def parse_grid_item(item: str) -> tuple[str, list]:
    """`"new=64,128"` → ("new", [64, 128]); `"overrides=num_hidden_layers=1"` keeps the text after the first `=`."""
    key, sep, values = item.partition("=")
    key = key.strip()
    parts = [part.strip() for part in values.split(",")] if key != "overrides" else [values.strip()]
    if not sep or not key or not all(parts):
        raise ValueError(f"grid item {item!r} is not of the form key=v1,v2,...; valid keys: {', '.join(DEFAULTS)}")
    return key, [parse_value(part) for part in parts]


def sweep_file(name: str | os.PathLike) -> Path:
    """A sweep file's path: an existing path, or the name of one shipped in kvlab/lab/sweeps/."""
    return shipped_or_path(name, SWEEPS_DIR, "sweep")


def read_sweep(path: str | os.PathLike) -> dict:
    """A YAML sweep file's sections, checked; a folder, or a file that is not YAML, is one line naming it."""
    path = sweep_file(path)
    spec = read_yaml(path, "sweep")
    if not isinstance(spec, dict) or set(spec) - {"fixed", "grid", "description", "point_timeout_s"}:
        raise ValueError(f"{path}: a sweep file has the sections fixed, grid (and description, point_timeout_s)")
    timeout = spec.get("point_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1):
        raise ValueError(f"{path}: point_timeout_s must be a positive number of seconds, got {timeout!r}")
    return spec


def load_sweep(path: str | os.PathLike) -> tuple[dict, dict]:
    """(fixed, grid) from a YAML sweep file."""
    spec = read_sweep(path)
    fixed, grid = spec.get("fixed") or {}, spec.get("grid") or {}
    if not isinstance(fixed, dict) or not isinstance(grid, dict):
        raise ValueError(f"{path}: `fixed` and `grid` must be mappings of parameter names")
    return fixed, {key: values if isinstance(values, list) else [values] for key, values in grid.items()}


def merge_grid_items(fixed: dict, grid: dict, items: list[str]) -> tuple[dict, dict]:
    """Command-line `--grid key=v1,v2` items on top of a sweep file's (fixed, grid): the command line wins, key by
    key."""
    fixed, grid = dict(fixed), dict(grid)
    for key, values in map(parse_grid_item, items):
        fixed.pop(key, None)
        grid.pop(key, None)
        for group, values_of_group in grid.items():  # also out of groups like `design: [{cache: ...}]`
            grid[group] = [
                {k: v for k, v in value.items() if k != key} if isinstance(value, dict) else value
                for value in values_of_group
            ]
        if len(values) == 1:
            fixed[key] = values[0]
        else:
            grid[key] = values
    return fixed, grid


def expand(fixed: dict, grid: dict) -> list[dict]:
    """The points of a grid: every combination of its values, on top of the fixed parameters; a value that is a
    mapping sets a group of parameters together, e.g. cache + loop."""
    if empty := [key for key, values in grid.items() if not values]:
        raise ValueError(f"grid key {empty[0]!r} has no values")
    groups = [[value if isinstance(value, dict) else {key: value} for value in values] for key, values in grid.items()]
    return [
        {key: value for group in (fixed, *combination) for key, value in group.items()}
        for combination in itertools.product(*groups)
    ]


def validate(points: list[dict], *, devices_here: bool = True) -> list[dict]:
    """Every point normalized (defaults filled, choices checked) before anything runs, each once. With
    `devices_here=False` (the Ray engine: CUDA points run elsewhere), a driver without a GPU checks CUDA points as
    CPU points (what runs on CUDA runs on a CPU) and keeps `cuda`, with CUDA's defaults."""
    if not points:
        raise ValueError("the sweep has no points")
    checked = []
    for point in points:
        try:
            if devices_here or not str(point.get("device", "")).startswith("cuda") or torch.cuda.is_available():
                checked.append(normalize(**point))
            else:  # checked as a CPU point, with what normalize says on CUDA: no storage tracking, kernels timed
                tracked = point.get("track_storages", "auto")
                checked.append(
                    dict(
                        normalize(**{**point, "device": "cpu"}),
                        device=point["device"],
                        track_storages=tracked != "auto" and is_true(tracked),
                        timing=is_true(point.get("timing", DEFAULTS["timing"])),
                    )
                )
        except ValueError as error:
            raise ValueError(f"point {json.dumps(point)}: {error}") from None
    return list({point_id(params): params for params in checked}.values())  # a grid may name a point twice


def point_id(params: dict) -> str:
    """A stable id from the normalized parameters: the same point gets the same id in every rerun."""
    # `force` changes whether a point runs, not what it measures: a forced rerun replaces a "too-big" row.
    canonical = json.dumps(
        {
            key: params[key]
            for key in DEFAULTS
            if key != "force" and not (key in LATER_PARAMETERS and params[key] == DEFAULTS[key])
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha1(canonical.encode()).hexdigest()[:12]


def point_label(params: dict) -> str:
    """A readable file name for a point's notebook and record."""
    overrides = "".join(ch if ch.isalnum() else "-" for ch in params["overrides"])
    parts = [
        params["preset"].replace("/", "-"),
        overrides,
        params["cache"],
        params["loop"],
        params["strategy"],
        f"b{params['batch']}",
        f"p{params['prompt']}",
        f"n{params['new']}",
    ]
    return "_".join(part for part in parts if part) + f"_{point_id(params)}"
