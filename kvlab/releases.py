"""The real releases kvlab's loops are checked against: transformers 4.40.1 (the last tuple-cache release) and
4.42.4 (PR #30536 as released), each installed once into its own folder, since an old release cannot share
transformers 5's process. `kvlab.lab.reference` measures their own `generate()`; `kvlab.explain` explains it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def release_values(config) -> dict:
    """CONFIG_KEYS' values of a 5.x config, and rope_theta (5.x nests it in rope_parameters)."""
    values = {key: getattr(config, key) for key in CONFIG_KEYS if hasattr(config, key)}
    rope = getattr(config, "rope_parameters", None) or {}
    return dict(values, rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
