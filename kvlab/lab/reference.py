"""The real thing: transformers' own `generate()`, measured with kvlab's meter, one release at a time
(`python -m kvlab measure --kind reference --cache tuple --loop v4.40` runs 4.40.1's).

An old release cannot share transformers 5's process: each is installed into its own folder (`pip --target`,
no dependencies resolved, with the libraries it was released with). Every release, the installed 5.x too, runs
in a fresh process (its folder first on PYTHONPATH) that imports only `kvlab.meter` (plain torch) and
`kvlab.models` (for the prompt; transformers' Auto classes at its top), builds the preset with that release's own
classes and prints JSON records.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from ..releases import INSTALLED, RELEASES, ROOT, install_reference, release_values
from ..schema import DEFAULTS, beams, over_kv

STRATEGIES = ("greedy", "beam")
# A reference point's parameters: these of the point's (kvlab.schema.DEFAULTS), and the cache_implementation.
REFERENCE_KEYS = (
    "preset",
    "overrides",
    "batch",
    "prompt",
    "new",
    "restart_new",
    "dtype",
    "strategy",
    "num_beams",
    "device",
    "seed",
)

# Where the releases differ most, each run by kvlab's loop and by the release's own generate() (kind reference):
# the 4.x forward's fp32 logits of every prompt position at the peak (the Llama-3-8B twin's 4008-token vocabulary),
# 4.42's default restart from the tuples it returned, and the Mistral twin at 2 new tokens, whose
# tuple/v4.40 over dynamic/v4.42 is the PR's "minimal improvement". scripts/reference_points.py writes them to
# data/reference/; tests/test_reference.py holds each within 1 %.
SHOWCASE = {
    "logits": dict(preset="llama3-8b-twin", cache="dynamic", loop="v4.42", prompt=300, new=8),
    "restart": dict(
        preset="llama2-7b-twin",
        cache="dynamic",
        loop="v4.42",
        prompt=300,
        new=100,
        restart_new=50,
        restart_from="tuples",
    ),
    "minimal-before": dict(preset="mistral-7b-twin", cache="tuple", loop="v4.40", prompt=300, new=2),
    "minimal-after": dict(preset="mistral-7b-twin", cache="dynamic", loop="v4.42", prompt=300, new=2),
}
SHOWCASE_COMMON = dict(dtype="bfloat16", batch=1, strategy="greedy", device="cpu", timing=False)


def showcase_table(results):
    """SHOWCASE's rows (data/reference/results.csv as a DataFrame) side by side: per point, overhead / final KV by
    kvlab's loop and by the release's own generate(), their ratio, and the logits' share of kvlab's peak."""
    import pandas as pd

    ours = results[results["kind"] == "kvlab"].set_index("name")
    real = results[results["kind"] == "reference"].set_index("name").loc[ours.index]
    return pd.DataFrame(
        {
            "design": ours["cache"] + "/" + ours["loop"],
            "release": real["transformers_version"],
            "kvlab overhead/KV": ours["overhead_over_kv"],
            "release overhead/KV": real["overhead_over_kv"],
            "kvlab / release": ours["overhead_bytes"] / real["overhead_bytes"],
            "logits share of the peak": ours["logits_at_peak_bytes"] / ours["overhead_bytes"],
        }
    ).round(4)


def measure_references(version: str, points: list[dict]) -> list[dict]:
    """Run release `version`'s own `generate()` at each point (a dict of REFERENCE_KEYS and cache_implementation,
    the rest kvlab.schema.DEFAULTS) in one subprocess; return their measured records. The release is imported
    once, and each point still builds its own model and prompt."""
    # Here, not above: the worker's process imports this module under old releases, which these need not load.
    from ..configs import load_config, parse_overrides
    from ..loops import check_choice
    from ..models import attention_of, final_kv_bytes, parse_dtype, resolve_device
    from ..weights import REAL_WEIGHTS, state_file

    # input_ids: the prompt's rows (lists of ids) instead of the seeded random prompt, e.g. kvlab.text's chat prompt.
    defaults = dict({key: DEFAULTS[key] for key in REFERENCE_KEYS}, cache_implementation=None, input_ids=None)
    specs = []
    for point in points:
        if unknown := set(point) - set(defaults):
            raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))}; valid: {', '.join(defaults)}")
        p = {**defaults, **point}
        if p["input_ids"] is not None:
            p["batch"], p["prompt"] = len(p["input_ids"]), len(p["input_ids"][0])
        p["device"] = resolve_device(p["device"])
        check_choice("strategy", p["strategy"], STRATEGIES)
        if p["cache_implementation"] is not None and version in RELEASES:
            raise ValueError(f"cache_implementation is for the installed 5.x; {version} only has its default cache")
        if p["restart_new"] and (version not in RELEASES or p["strategy"] != "greedy"):
            raise ValueError(
                f"a restart passes back the tuples a 4.x release returns, greedy; choose one of: {', '.join(RELEASES)}"
            )
        parse_dtype(p["dtype"])
        config = load_config(p["preset"], p["overrides"])  # raises on a bad preset or override, before any subprocess
        if version == INSTALLED:  # the same release: every value (layer_types, head_dim, experts, rope), as is
            values = {
                key: value
                for key, value in config.to_dict().items()
                if not key.startswith("_")
                and key not in ("transformers_version", "architectures", "dtype", "model_type")
            }
            # to_dict writes an infinite float as {"__float__": "Infinity"} (Mamba-2's time_step_limit); the worker
            # passes each value back to the config class, which wants the float (Python's json carries it).
            values = getattr(config, "_decode_special_floats", lambda v: v)(values)
            if getattr(config, "_experts_implementation", None):  # to_dict leaves out how experts run (eager: a loop)
                values["experts_implementation"] = config._experts_implementation
        else:
            values = release_values(config)
        p["overrides"] = ",".join(f"{k}={v}" for k, v in parse_overrides(p["overrides"]).items())  # as kvlab's records
        p["num_beams"] = beams(p)
        p["kv_final_bytes"] = final_kv_bytes(
            config, p["batch"] * p["num_beams"], p["prompt"] + p["new"] + p["restart_new"], p["dtype"]
        )
        weights = str(state_file(p["preset"])) if p["preset"] in REAL_WEIGHTS else None
        specs.append(
            dict(p, model_type=config.model_type, config=values, attention=attention_of(config), weights=weights)
        )
    target = install_reference(version)
    path = [str(ROOT)] if target is None else [str(target), str(ROOT)]
    job = json.dumps(dict(version=version, points=specs))
    result = subprocess.run(
        [sys.executable, "-m", "kvlab.lab.reference", job],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"transformers {version} run failed:\n{result.stderr[-3000:]}")
    return [
        dict(record, overhead_over_kv=over_kv(record["overhead_bytes"], record["kv_final_bytes"]))
        for record in json.loads(result.stdout.strip().splitlines()[-1])
    ]


def weights_digest(model) -> str:
    """sha256 of every parameter's bytes in name order: equal digests mean identical weights."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _worker(job: dict) -> list[dict]:
    """Runs inside the subprocess, with whichever transformers is first on the path."""
    import torch
    import transformers

    version = transformers.__version__
    if job["version"] != INSTALLED and version != job["version"]:
        raise RuntimeError(f"asked for transformers {job['version']}, imported {version} from {transformers.__file__}")
    # Memory does not depend on the thread count; one thread keeps OpenMP from spinning against
    # other processes on a small CPU (kvlab's sweep does the same).
    torch.set_num_threads(1)
    return [
        dict(_measure_point(spec), transformers_version=version, torch_version=torch.__version__)
        for spec in job["points"]
    ]


def _measure_point(spec: dict) -> dict:
    import gc

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..meter import MemoryMeter
    from ..models import random_prompt  # (that module imports nothing a 4.x release lacks at its top)
    from ..weights import load_state

    before_5 = int(transformers.__version__.split(".")[0]) < 5
    dtype = getattr(torch, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(spec["dtype"], spec["dtype"]))
    config = AutoConfig.for_model(spec["model_type"], **spec["config"], attn_implementation=spec["attention"])
    config.eos_token_id = None  # never stop early: every run decodes exactly `new` tokens
    config.use_cache = True
    # As kvlab.models.build_model: seed, then build on the device (weights equal only if init order is).
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):
        model = AutoModelForCausalLM.from_config(config, **{"torch_dtype" if before_5 else "dtype": dtype}).eval()
    if spec["weights"]:  # a real-weights preset: the same weights in every release
        load_state(model, spec["weights"], dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    # The prompt kvlab.lab.point.measure draws (or the one given); it and its mask exist before the meter starts.
    if spec["input_ids"] is not None:
        ids = torch.tensor(spec["input_ids"], device=spec["device"])
    else:
        ids = random_prompt(config.vocab_size, spec["batch"], spec["prompt"], spec["seed"]).to(spec["device"])
    mask = torch.ones_like(ids)
    options = dict(
        max_new_tokens=spec["new"],
        min_new_tokens=spec["new"],
        do_sample=False,
        num_beams=spec["num_beams"],
        num_return_sequences=1,
        pad_token_id=0,
    )
    if spec["num_beams"] > 1:
        options["early_stopping"] = True  # moot without EOS (no beam finishes); the length check below proves it
    if spec["cache_implementation"]:
        options["cache_implementation"] = spec["cache_implementation"]
    gc.collect()  # nothing of the previous point may die inside this one's meter
    with torch.no_grad(), MemoryMeter(spec["device"], model) as meter:
        if spec["restart_new"]:
            # As the PR's restart example: the caller holds `first` and passes back its past_key_values, which
            # 4.x's generate() returns as tuples (4.42: return_legacy_cache=True by default).
            first = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options)
            ids, more = first.sequences, spec["restart_new"]
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=first.past_key_values,
                **dict(options, max_new_tokens=more, min_new_tokens=more),
            )
            del first
        else:
            out = model.generate(ids, attention_mask=mask, **options)
    if out.shape != (spec["batch"], spec["prompt"] + spec["new"] + spec["restart_new"]):
        raise RuntimeError(f"generate() returned shape {tuple(out.shape)}, not (batch, prompt + new)")
    report, tokens = meter.report(), out[:, spec["prompt"] :].tolist()
    return dict(
        {k: v for k, v in spec.items() if k not in ("model_type", "config", "attention", "input_ids", "weights")},
        baseline_bytes=report.baseline_bytes,
        peak_bytes=report.peak_bytes,
        overhead_bytes=report.overhead_bytes,
        meter=report.method,
        weights_sha256=weights_digest(model),
        tokens_sha256=hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        tokens=tokens,
    )


if __name__ == "__main__":  # the worker's entry point: measure_references runs `python -m kvlab.lab.reference JOB`
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
