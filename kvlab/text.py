"""Real text from the running example, SmolLM2-135M-Instruct (`kvlab.weights`): its tokenizer, the chat prompt of
a question, and the answer that a real transformers release's own `generate()` decodes from it.

kvlab's loops decode the same ids (`kvlab.loops.generate(model, chat_ids(), new)`), so "every design decodes the
same tokens" can be shown as a sentence rather than a list of ids.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache

import torch

from .lab.reference import measure_references
from .weights import cache_dir, gguf_path

PRESET = "smollm2-135m"
QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 8  # "The capital of France is Paris." is 8 tokens; the 9th is the end of the turn


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


def chat_ids(question: str = QUESTION, batch: int = 1) -> torch.Tensor:
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


def release_text(version: str, question: str = QUESTION, new: int = ANSWER_TOKENS, strategy: str = "greedy") -> str:
    """The answer transformers `version` ("4.40.1", "4.42.4" or "installed") decodes with its own `generate()`,
    given SmolLM2's weights and the chat prompt of `question`, in fp32 on the CPU (beam: 4 beams)."""
    point = dict(preset=PRESET, input_ids=chat_ids(question).tolist(), new=new, strategy=strategy, dtype="float32")
    (record,) = measure_references(version, [point])
    return decode(record["tokens"][0])


# What a lossy cache costs in text: the running example's answer with each quantized cache of kvlab.savers. The
# integer backends quantize the prompt at once and then every `residual_length` new tokens; 16 (not their 128) so
# that the answer's own keys and values are quantized too.
SAVER_QUESTION = "Explain in three sentences why the sky is blue."
SAVER_TOKENS = 60
LOSSY = ("fp8", "quanto-int4", "hqq-int4", "quanto-int2")


def saver_options(name: str) -> dict:
    """generate()'s options for saver `name` (kvlab.savers.SAVERS), the integer backends' residual set to 16."""
    from .savers import SAVERS

    options = dict(SAVERS[name]["generate"])
    if options["cache_config"]["backend"] != "fp8":
        options["cache_config"] = dict(options["cache_config"], residual_length=16)
    return options


def saver_answers(question: str = SAVER_QUESTION, new: int = SAVER_TOKENS, names=LOSSY) -> list[dict]:
    """SmolLM2-135M-Instruct's greedy answer (fp32, transformers' own generate(), at most `new` tokens, to the end
    of its turn) with its default cache and with each lossy saver of `names`: the text, the share of the default
    answer's positions that decode its token, the first position that does not (None: none)."""
    from .explain import generate_call
    from .models import build_model
    from .savers import options_text

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
                generate=options_text(options),
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
