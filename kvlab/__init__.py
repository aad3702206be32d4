"""kvlab: measure where the memory of LLM generation goes, one KV-cache design at a time."""

__version__ = "0.1.0"
