"""The real thing: transformers' own `generate()`, measured with kvlab's meter, one release at a time
(`python -m kvlab measure --kind reference --cache tuple --loop v4.40` runs 4.40.1's).

This module is the worker `kvlab.releases.measure_references` starts: a fresh process for each release (its
folder first on PYTHONPATH, the installed 5.x too) that imports only `kvlab.meter` (plain torch) and
`kvlab.models` (for the prompt; transformers' Auto classes at its top), builds the preset with that release's own
classes and prints JSON records. Beside it, SHOWCASE: the points where the releases differ most.
"""

from __future__ import annotations

import hashlib
import json
import sys

from ..releases import INSTALLED

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
