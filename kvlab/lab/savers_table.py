"""The stored tables of kvlab.savers (`python -m kvlab savers`): OUT/savers.csv, and the running example's answer
with each lossy saver (`python -m kvlab savers text`: OUT/savers_text.csv, appendix A11 quotes it), each run logged in
OUT/provenance.json with the quantization backends' versions. Measuring is kvlab.savers'; writing is the lab's."""

from __future__ import annotations

import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from .. import savers
from ..weights import PRESET, chat_ids, decode, tokenizer
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


# What a lossy cache costs in text: the running example's answer with each quantized cache of kvlab.savers. The
# integer backends quantize the prompt at once and then every `residual_length` new tokens; 16 (not their 128) so
# that the answer's own keys and values are quantized too.
SAVER_QUESTION = "Explain in three sentences why the sky is blue."
SAVER_TOKENS = 60
LOSSY = ("fp8", "quanto-int4", "hqq-int4", "quanto-int2")


def saver_options(name: str) -> dict:
    """generate()'s options for saver `name` (kvlab.savers.SAVERS), the integer backends' residual set to 16."""
    options = dict(savers.SAVERS[name]["generate"])
    if options["cache_config"]["backend"] != "fp8":
        options["cache_config"] = dict(options["cache_config"], residual_length=16)
    return options


def saver_answers(question: str = SAVER_QUESTION, new: int = SAVER_TOKENS, names=LOSSY) -> list[dict]:
    """SmolLM2-135M-Instruct's greedy answer (fp32, transformers' own generate(), at most `new` tokens, to the end
    of its turn) with its default cache and with each lossy saver of `names`: the text, the share of the default
    answer's positions that decode its token, the first position that does not (None: none)."""
    from ..explain import generate_call
    from ..models import build_model

    model = build_model(PRESET, dtype="float32")
    ids = chat_ids(question)
    rows = []
    for name in ("default", *names):
        options = {} if name == "default" else saver_options(name)
        with torch.no_grad():
            tokens = _answer(generate_call(model, ids, new, **options)()[0, ids.shape[1] :])
        default = rows[0]["ids"] if rows else tokens
        same = torch.zeros(len(default), dtype=torch.bool)
        n = min(len(tokens), len(default))
        same[:n] = tokens[:n] == default[:n]
        rows.append(
            dict(
                saver=name,
                generate=savers.options_text(options),
                same_tokens=round(same.float().mean().item(), 3),
                first_difference=_first_difference(same, len(tokens), len(default)),
                text=decode(tokens),
                ids=tokens,
            )
        )
    return [{key: value for key, value in row.items() if key != "ids"} for row in rows]


def _first_difference(same: torch.Tensor, length: int, default: int) -> int | None:
    """The first position whose token differs from the default answer's, or where one answer ends before the other;
    None where both are the same."""
    if not same.all():
        return int((~same).nonzero()[0])
    return None if length == default else min(length, default)


def _answer(tokens: torch.Tensor) -> torch.Tensor:
    """The new tokens up to the end of the assistant's turn (generate_call decodes a fixed number past it)."""
    ends = (tokens == tokenizer().eos_token_id).nonzero()
    return tokens[: int(ends[0])] if len(ends) else tokens
