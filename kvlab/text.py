"""Real text from the running example, SmolLM2-135M-Instruct: its question, the chat prompt that asks it and new ids
as text (`kvlab.weights`' tokenizer, read from the GGUF file), and the answer that a real transformers release's own
`generate()` decodes from it.

kvlab's loops decode the same ids (`kvlab.loops.generate(model, chat_ids(QUESTION), new)`), so "every design
decodes the same tokens" can be shown as a sentence rather than a list of ids.
"""

from __future__ import annotations

from .releases import measure_references
from .weights import PRESET, chat_ids, decode

QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 8  # "The capital of France is Paris." is 8 tokens; the 9th is the end of the turn


def release_text(version: str, question: str = QUESTION, new: int = ANSWER_TOKENS, strategy: str = "greedy") -> str:
    """The answer transformers `version` ("4.40.1", "4.42.4" or "installed") decodes with its own `generate()`,
    given SmolLM2's weights and the chat prompt of `question`, in fp32 on the CPU (beam: 4 beams)."""
    point = dict(preset=PRESET, input_ids=chat_ids(question).tolist(), new=new, strategy=strategy, dtype="float32")
    (record,) = measure_references(version, [point])
    return decode(record["tokens"][0])
