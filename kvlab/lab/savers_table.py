"""The stored table of kvlab.savers (`python -m kvlab savers`): OUT/savers.csv, each run logged in
OUT/provenance.json with the quantization backends' versions. Measuring is kvlab.savers'; writing is the lab's."""

from __future__ import annotations

import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from .. import savers
from .store import append_run, prepare_folder

BACKENDS = {"quanto": "optimum-quanto", "hqq": "hqq"}  # the packages the quantized caches run on (extra `savers`)


def check_names(names) -> list[str]:
    """The savers asked for (all of kvlab.savers.SAVERS if none); an unknown one refused before any run."""
    names = list(names or savers.SAVERS)
    if unknown := [name for name in names if name not in savers.SAVERS]:
        raise ValueError(f"unknown saver {', '.join(map(repr, unknown))}; choose from: {', '.join(savers.SAVERS)}")
    return names


def backend_versions(names=None) -> dict:
    """The installed version of each backend package the savers `names` run on (all of them if None); a missing
    one is refused with how to install it."""
    wanted = [savers.SAVERS[name]["generate"].get("cache_config", {}).get("backend") for name in names or []]
    versions = {}
    for backend, package in BACKENDS.items():
        if names is not None and backend not in wanted:
            continue
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            raise ValueError(f"the quantized caches need {package}: pip install 'kvlab[savers]'") from None
    return versions


def write_savers(names, out, command: str) -> None:
    """Measure and predict the savers `names` and store their rows in OUT/savers.csv (a saver's row replaces its
    stored one; SAVERS' order kept); `command` is what provenance.json logs for the run."""
    names = check_names(names)
    versions = backend_versions(names)
    import pandas as pd
    from tqdm.auto import tqdm

    torch.set_num_threads(1)  # as kvlab.waste's tables: one thread, so that CPU kernels pick the same paths
    started = datetime.datetime.now(datetime.timezone.utc)
    out = Path(out)
    prepare_folder(out, folders=())
    path = out / "savers.csv"
    for name in tqdm(names, desc="savers", unit="saver"):
        row = pd.DataFrame([savers.row(name)], columns=savers.COLUMNS)
        kept = pd.read_csv(path, keep_default_na=False) if path.exists() else pd.DataFrame(columns=savers.COLUMNS)
        table = pd.concat([kept[kept["saver"] != name], row])
        order = table["saver"].map({saver: i for i, saver in enumerate(savers.SAVERS)}).fillna(len(savers.SAVERS))
        table.iloc[order.argsort(kind="stable")].to_csv(path, index=False)
        shown = [
            "saver",
            "kv_saved_bytes",
            "kv_saved_predicted_bytes",
            "peak_saved_bytes",
            "peak_saved_predicted_bytes",
        ]
        tqdm.write(row[shown].to_string(index=False))
    append_run(
        out,
        command,
        started,
        "cpu",
        savers=names,
        results_file="savers.csv",
        what="kvlab.savers: transformers' own generate() with each saver and without it under the meter, its peak "
        "named by kvlab.explain; KV predicted from the shapes, peaks by a dry run on meta; the CPU allocator's "
        "events, the live-storage counter beside it for attribution, one thread",
        backends=versions,
    )
