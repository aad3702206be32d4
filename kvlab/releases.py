"""The real releases kvlab's loops are checked against: transformers 4.40.1 (the last tuple-cache release) and
4.42.4 (PR #30536 as released), each installed once into its own folder, since an old release cannot share
transformers 5's process; `measure_references` runs a release's own `generate()` in a fresh process under kvlab's
meter (the worker: `kvlab.lab.reference`); `kvlab.explain` explains it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .schema import DEFAULTS, beams, over_kv

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = "installed"  # the transformers 5.x of this environment

# Each old release with the pins it needs, into its own folder. 4.40.1 imports fine next to numpy 2;
# 4.42.4 declares numpy<2 and its import-time dependency check refuses numpy 2, so its folder carries
# numpy 1.26.4 (torch 2.13 still runs with it) and the safetensors it was released against.
RELEASES = {
    "4.40.1": (ROOT / ".legacy-tf", ("transformers==4.40.1", "tokenizers==0.19.1", "huggingface-hub==0.23.4")),
    "4.42.4": (
        ROOT / ".legacy-tf-4.42",
        (
            "transformers==4.42.4",
            "tokenizers==0.19.1",
            "huggingface-hub==0.23.4",
            "numpy==1.26.4",
            "safetensors==0.4.3",
        ),
    ),
}
# The config values that shape the memory and the weights (initializer_range: kvlab.presets.RANDOM_INIT_STD);
# plain values, so any release's config class accepts them.
CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "sliding_window",
    "use_sliding_window",
    "initializer_range",
)


class ReferenceInstallError(RuntimeError):
    """pip could not install a release (no package index reachable, or no wheel for this Python)."""


def install_reference(version: str) -> Path | None:
    """Install `version` into its own folder once and return the folder (None for the installed 5.x)."""
    if version == INSTALLED:
        return None
    if version not in RELEASES:
        raise ValueError(
            f"unknown transformers release {version!r}; choose one of: {', '.join([*RELEASES, INSTALLED])}"
        )
    target, pins = RELEASES[version]
    # Every pin's dist-info, not just transformers': an interrupted install must be redone.
    if not all(
        (target / f"{name.replace('-', '_')}-{pinned}.dist-info").exists()
        for name, pinned in (pin.split("==") for pin in pins)
    ):
        print(
            f"installing {' '.join(pins)} into {target} (once, for reference points; needs a package index)",
            file=sys.stderr,
            flush=True,
        )
        # --upgrade replaces a half-installed package; --no-deps keeps transformers 5's pins out of the folder.
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--upgrade",
                "--target",
                str(target),
                *pins,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise ReferenceInstallError(
                f"pip could not install {' '.join(pins)} into {target} (is a package index reachable?): {reason}"
            )
    return target


# Lesson 02's diff of PR #30536: the places of transformers 4.40.1 and 4.42.4 that decide what greedy decoding
# with a Llama model holds (the copy and the logits are unchanged; the others the PR changed). Each: a title, the
# file under transformers/, and per release the line after which to look (a def, a class or a unique line), the
# excerpt's first line and the line that ends it (not included), each as its text begins, indentation aside.
# 4.40.1's greedy search is `_greedy_search`; 4.42.4's generate() sends it to `_sample` (its `_greedy_search` is a
# deprecated wrapper). 4.42.4's excerpt of the cache it is given stops before the deprecation warning it logs.
PR_EXCERPTS = [
    (
        "DynamicCache.update: the copy",
        "cache_utils.py",
        {
            version: ("class DynamicCache(", "self.key_cache[layer_idx] = torch.cat", "return self.key")
            for version in ("4.40.1", "4.42.4")
        },
    ),
    (
        "LlamaModel.forward: the cache it is given",
        "models/llama/modeling_llama.py",
        {
            "4.40.1": ("class LlamaModel(", "past_seen_tokens = 0", "if cache_position is None:"),
            "4.42.4": ("class LlamaModel(", "return_legacy_cache = False", "logger.warning_once("),
        },
    ),
    (
        "LlamaModel.forward: the cache it returns",
        "models/llama/modeling_llama.py",
        {
            "4.40.1": ("class LlamaModel(", "next_cache = None", "if not return_dict:"),
            "4.42.4": ("class LlamaModel(", "next_cache = next_decoder_cache", "if not return_dict:"),
        },
    ),
    (
        "generate(): the cache it starts with (4.42.4: the branch for no `cache_implementation`)",
        "generation/utils.py",
        {
            "4.40.1": ("def generate(", "self._validate_generated_length(", "# 7. determine"),
            "4.42.4": ("def generate(", "# Use DynamicCache() instance by default", "# 7. determine"),
        },
    ),
    (
        "the greedy loop (4.42.4: `_sample`, where generate() sends greedy search): the next token's logits",
        "generation/utils.py",
        {
            "4.40.1": ("def _greedy_search(", "if synced_gpus and", "# pre-process"),
            "4.42.4": ("def _sample(", "if synced_gpus and", "# pre-process"),
        },
    ),
    (
        "the greedy loop (4.42.4: `_sample`): the end of a step",
        "generation/utils.py",
        {
            "4.40.1": ("def _greedy_search(", "unfinished_sequences = unfinished", "if streamer"),
            "4.42.4": ("def _sample(", "unfinished_sequences = unfinished", "if streamer"),
        },
    ),
    (
        "LlamaForCausalLM.forward: the logits",
        "models/llama/modeling_llama.py",
        {version: ("logits = torch.cat(logits, dim=-1)", "else:", "loss = None") for version in ("4.40.1", "4.42.4")},
    ),
]


def cut_excerpts() -> dict:
    """{release: {title: {"path", "line", "lines"}}}: PR_EXCERPTS cut from the installed 4.40.1 and 4.42.4 (each
    installed once: `install_reference`). `python scripts/pr_excerpts.py` writes them to data/reference/."""
    excerpts = {version: {} for version in ("4.40.1", "4.42.4")}
    for title, path, anchors in PR_EXCERPTS:
        for version, (after, start, stop) in anchors.items():
            lines = (install_reference(version) / "transformers" / path).read_text().splitlines()
            first = next(i for i, line in enumerate(lines) if line.lstrip().startswith(after))
            begin = next(i for i in range(first, len(lines)) if lines[i].lstrip().startswith(start))
            end = next(i for i in range(begin + 1, len(lines)) if lines[i].lstrip().startswith(stop))
            excerpts[version][title] = {"path": path, "line": begin + 1, "lines": lines[begin:end]}
    return excerpts


def release_values(config) -> dict:
    """CONFIG_KEYS' values of a 5.x config, and rope_theta (5.x nests it in rope_parameters)."""
    values = {key: getattr(config, key) for key in CONFIG_KEYS if hasattr(config, key)}
    rope = getattr(config, "rope_parameters", None) or {}
    return dict(values, rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


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


def measure_references(version: str, points: list[dict], load_config=None) -> list[dict]:
    """Run release `version`'s own `generate()` at each point (a dict of REFERENCE_KEYS and cache_implementation,
    the rest kvlab.schema.DEFAULTS) in one subprocess; return their measured records. The release is imported
    once, and each point still builds its own model and prompt. `load_config(preset, overrides)`: a point's config,
    kvlab.configs.build_config's of a preset unless given (kvlab.planner.sources.load_config: any source)."""
    # Here, not above: the worker's process imports this module under old releases, which these need not load.
    from .configs import build_config, parse_overrides
    from .models import attention_of, final_kv_bytes, parse_dtype, resolve_device
    from .schema import check_choice
    from .weights import REAL_WEIGHTS, state_file

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
        # raises on a bad preset or override, before any subprocess
        config = (load_config or build_config)(p["preset"], p["overrides"])
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
