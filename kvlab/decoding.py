"""Seeded sampling and beam search: the strategies kvlab.loops.generate runs beside its greedy one (lesson 04).

Each is a `kvlab.loops.Greedy`: the rows the loop decodes (beam search: `num_beams` per prompt row), the callable
that picks each step's next tokens and keeps what generate() kept between steps (`_Sample`, `_BeamSearch`), and
the cache's reorder after a beam step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .loops import Choose, Greedy, cache_batch
from .schema import STRATEGIES, Release, check_choice


@dataclass(frozen=True)
class Sampling(Greedy):
    """strategy="sample": transformers' logits warpers (1, 0 and 1 leave them out) and the generator's seed."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    name = "sample"

    def warpers(self) -> LogitsProcessorList:
        return LogitsProcessorList(
            ([TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else [])
            + ([TopKLogitsWarper(self.top_k)] if self.top_k > 0 else [])
            + ([TopPLogitsWarper(self.top_p)] if self.top_p < 1.0 else [])
        )

    def choice(self, release: Release, tokens, new_tokens: int):
        return _Sample(self, tokens.device)


@dataclass(frozen=True)
class Beams(Greedy):
    """strategy="beam": `num_beams` continuations kept per row of the prompt."""

    num_beams: int = 4
    name = "beam"

    def rows(self, input_ids, past):
        if past is None:
            return input_ids.repeat_interleave(self.num_beams, dim=0)  # as generate() does, before the prompt
        if input_ids.shape[0] != cache_batch(past):
            raise ValueError("a beam-search restart needs the tokens of the first call (batch * beams rows)")
        return input_ids

    def choice(self, release: Release, tokens, new_tokens: int):
        return _BeamSearch(release, tokens, new_tokens, self.num_beams)

    def reorder(self, kv, choose) -> None:
        # One tensor at a time; tuple / v4.40: `outputs` still holds the un-reordered tuple, so its reordered copy
        # is built while the whole old one lives.
        kv.reorder_cache(choose.beam_idx)


def decoding(strategy: str, num_beams: int = 4, sampling: Sampling = Sampling()):
    """What `generate(strategy=...)` takes for a point's strategy name and beam count."""
    check_choice("strategy", strategy, STRATEGIES)
    return {"greedy": "greedy", "sample": sampling, "beam": Beams(num_beams)}[strategy]


class _Sample(Choose):
    """Seeded sampling from the warped probabilities (kept, as generate()'s `probs`)."""

    def __init__(self, sampling: Sampling, device):
        self.warpers = sampling.warpers()
        self.generator = torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(sampling.seed)

    def __call__(self, tokens, next_logits):
        self.probs = self.warpers(tokens, next_logits).softmax(dim=-1)
        self.next_tokens = torch.multinomial(self.probs, 1, generator=self.generator).squeeze(1)
        return tokens


class _BeamSearch(Choose):
    """Beam search: each row keeps its `num_beams` best continuations by summed log-probability; `.beam_idx` is the
    row each continuation came from, for the cache's reorder. Kept between steps as generate() kept them: the
    scores over the vocabulary, the top scores and ids, the source beams."""

    def __init__(self, release: Release, tokens, new_tokens: int, num_beams: int):
        device, self.num_beams = tokens.device, num_beams
        self.batch = tokens.shape[0] // num_beams
        # Only the first beam of each row is live at the start, so the beams do not all pick the same token.
        beam_scores = torch.zeros(self.batch, num_beams, device=device)
        beam_scores[:, 1:] = -1e9
        self.beam_scores = beam_scores.view(-1)
        if release.major == 5:
            # v5: beam search preallocates its running and finished sequences and their beam indices at full
            # length. Held only to occupy their bytes for the whole loop: kvlab never reads them.
            length = tokens.shape[1] + new_tokens
            self.buffers = [torch.zeros(self.batch, num_beams, length, dtype=torch.long, device=device) for _ in "ab"]
            self.buffers += [
                torch.zeros(self.batch, num_beams, new_tokens, dtype=torch.int32, device=device) for _ in "ab"
            ]

    def __call__(self, tokens, next_logits):
        batch, num_beams, vocab = self.batch, self.num_beams, next_logits.shape[-1]
        # As generate() binds them (5.x `log_probs`, 4.x `next_token_scores`): the log-probabilities first, so the
        # previous step's scores die before the sum with the beam scores is made (held beside them, one vocabulary
        # of fp32 per row too many: +13.6 % in bf16 with a 50,000-token vocabulary).
        self.scores = next_logits.log_softmax(dim=-1)
        self.scores = self.scores + self.beam_scores[:, None]
        self.top_scores, self.top_ids = self.scores.view(batch, -1).topk(num_beams, dim=1)
        self.beam_scores = self.top_scores.view(-1)
        self.source_beam = self.top_ids // vocab + torch.arange(batch, device=tokens.device)[:, None] * num_beams
        self.beam_idx, self.next_tokens = self.source_beam.view(-1), (self.top_ids % vocab).view(-1)
        return tokens.index_select(0, self.beam_idx)
