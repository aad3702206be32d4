"""Real text from the running example, SmolLM2-135M-Instruct: its question, the chat prompt that asks it and new ids
as text (`kvlab.weights`' tokenizer, read from the GGUF file).

kvlab's loops decode the chat prompt's ids (`kvlab.loops.generate(model, chat_ids(QUESTION), new)`), so "every
design decodes the same tokens" can be shown as a sentence rather than a list of ids (appendix A4 and
tests/test_smollm2.py set the real releases' own `generate()` beside them: `kvlab.releases.measure_references`).
"""

from __future__ import annotations

from .weights import PRESET, chat_ids, decode

__all__ = ["PRESET", "QUESTION", "ANSWER_TOKENS", "chat_ids", "decode"]

QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 8  # "The capital of France is Paris." is 8 tokens; the 9th is the end of the turn
