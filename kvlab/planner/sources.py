"""A model's config, and the model, from any source: a preset (kvlab.configs, kvlab.models), a local config.json (or
its folder) or a hub id (the local cache first, then the hub if it can be reached, with its real weights), overrides
checked before anything is built; a config kvlab cannot decode with, refused in one line (`check_decoder`). The
planner, the lab and the command line take any of these; the lessons build presets.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

# The presets beyond the lessons', registered on import: every user of the planner takes every name.
from .. import catalogue, encdec  # noqa: F401
from ..configs import build_config, choices, finish_config, one_line
from ..models import check_device, model_class, parse_dtype, random_model, ready_to_generate
from ..presets import DECODERS, PRESETS

CHOICES = f"{choices()}, a config.json path or a hub id like Qwen/Qwen2.5-0.5B"


def build_model(source: str = "toy", overrides=None, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """kvlab.models.build_model from any source: a preset or a local config.json with seeded random weights (real
    ones for the presets of kvlab.weights.REAL_WEIGHTS), a hub id with its real weights."""
    check_device(device)
    torch_dtype = parse_dtype(dtype)
    config = load_config(source, overrides)
    if not is_hub_id(source):
        return random_model(config, device, torch_dtype, seed, source)
    online = hub_reachable()
    try:
        # use_kernels=False: from 5.25 transformers swaps layers for the hub's `kernels` by default (and refuses
        # without that package); kvlab measures transformers' own layers. 5.17-5.24 take it too (default False).
        model = (
            model_class(config)
            .from_pretrained(source, config=config, dtype=torch_dtype, use_kernels=False, local_files_only=not online)
            .to(device)
        )
    except OSError:
        raise hub_error(source, online) from None
    return ready_to_generate(model)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all: without network, transformers retries for ~25 s."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection((urlparse(constants.ENDPOINT).hostname, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_error(name: str, online: bool) -> ValueError:
    where = (
        "the hub has no such model either"
        if online
        else "configs and weights cannot be downloaded here (no network to the Hugging Face hub)"
    )
    return ValueError(f"{name!r} is not in the local Hugging Face cache and {where}; choose one of: {CHOICES}")


def is_hub_id(source: str) -> bool:
    """`owner/name` with no such local path (nor a .json name): a model on the Hugging Face hub."""
    if "/" not in source or source.endswith(".json") or Path(source).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:  # ./x/config.json, /abs/path, a/b/c: local paths
        return False
    return True


def _hub_config(source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError:
        online = hub_reachable()
        if online:
            with contextlib.suppress(OSError):
                return AutoConfig.from_pretrained(source)
        raise hub_error(source, online) from None


def _local_config(source: str):
    """A config.json, or the folder holding one; what is wrong with it, named, in one line."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"{source}: no such file or folder; choose one of: {CHOICES}")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: a folder without a config.json")
    try:  # JSON first: its error says where the file breaks, transformers' does not
        json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not a JSON file ({one_line(error)})") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(file)
    except Exception as error:  # any reason transformers gives (no model_type, a validator, a bad value): one line
        raise ValueError(f"{file}: transformers refuses this config ({one_line(error)})") from None


def check_decoder(config, source: str) -> None:
    """Refuse, in one line, a config kvlab cannot decode with: an encoder-decoder (appendix A10 serves those), an
    encoder-only model such as BERT (it reads text and generates none: its causal-LM head is a decoder only when
    built as one, with is_decoder) and a model with no causal LM at all, such as a vision model (ViT)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.model_type
    if config.is_encoder_decoder:
        raise ValueError(
            f"{source} is an encoder-decoder model: measure, predict, compare and sweep run decoders; "
            "appendix A10 serves them (kvlab.encdec)"
        )
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        why = f"{source} is an encoder-only model ({kind}): it reads text and generates none"
    elif kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = f"{source} is not a text decoder ({kind}: transformers has no causal language model of it)"
    else:
        return
    raise ValueError(f"{why}; kvlab measures generation: give a decoder, one of the presets {', '.join(DECODERS)}")


def load_config(source: str, overrides=None):
    """A config from a preset name, a local config.json (or its folder), or a hub id (local cache first, then the
    hub if it can be reached); overrides checked and applied."""
    if source in PRESETS:
        return build_config(source, overrides)
    if is_hub_id(source):
        config = _hub_config(source)
    elif "/" in source or source.endswith(".json") or Path(source).exists():
        config = _local_config(source)
    else:
        raise ValueError(f"unknown preset {source!r}; choose one of: {CHOICES}")
    text = config.get_text_config(decoder=True)
    if text is not config and not config.is_encoder_decoder:
        # An image-text checkpoint (Gemma-3's `gemma3`): the KV cache is its text decoder's, which is what is built.
        print(
            f"{source}: {config.model_type} is an image-text model; kvlab builds its text decoder "
            f"({text.model_type}), without the vision tower",
            file=sys.stderr,
        )
        config = text
    finished = finish_config(type(config), config.to_dict(), overrides, source)
    if getattr(config, "_experts_implementation", None) and not getattr(finished, "_experts_implementation", None):
        finished._experts_implementation = config._experts_implementation  # to_dict leaves out how experts run
    return finished
