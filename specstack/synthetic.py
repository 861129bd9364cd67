"""Synthetic language models with known distributions, for tests and examples.

A :class:`SyntheticLM` maps the tokens it can see to a fixed pseudo-random logit vector: the same
visible context always gives the same distribution, so the exact probability of any continuation
can be computed (:func:`sequence_probabilities`) and compared with what a stack generates. A draft
is made correlated with a target through ``base``; ``support`` restricts the tokens a model can emit.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from .errors import SpecstackError
from .sampling import SamplingConfig, warp
from .types import Capability


@attrs.define(eq=False)
class TokenCache:
    """The synthetic model's "KV" store: the token at each occupied slot, behind a length pointer."""

    capacity: int
    tokens: torch.Tensor = attrs.field(init=False)  # [capacity]
    slot_positions: torch.Tensor = attrs.field(init=False)  # [capacity]
    length: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.tokens = torch.zeros(self.capacity, dtype=torch.long)
        self.slot_positions = torch.zeros(self.capacity, dtype=torch.long)

    def __len__(self) -> int:
        return self.length

    @property
    def positions(self) -> torch.Tensor:
        return self.slot_positions[: self.length]  # [n]

    def truncate(self, position: int) -> None:
        self.length = int(torch.searchsorted(self.positions, position))

    def keep(self, slots: torch.Tensor) -> None:
        n = slots.shape[0]
        self.tokens[:n] = self.tokens[slots]
        self.slot_positions[:n] = self.slot_positions[slots]
        self.length = n

    def append(self, token: int, position: int) -> None:
        if self.length == self.capacity:
            raise SpecstackError(f"cache full: capacity {self.capacity} slots")
        self.tokens[self.length] = token
        self.slot_positions[self.length] = position
        self.length += 1

    def visible(self) -> list[int]:
        return self.tokens[: self.length].tolist()


@attrs.define(eq=False, kw_only=True)
class SyntheticLM:
    """A prefix-hash language model over a small vocabulary.

    ``logits_for(context)`` is ``sharpness * N(0, 1)`` drawn from a generator seeded by a hash of
    ``(seed, context)``; with ``base`` set it is ``base.logits_for(context) + noise * that``. Tokens
    outside ``support`` get -inf.
    """

    vocab_size: int
    seed: int = 0
    sharpness: float = 1.0
    base: "SyntheticLM | None" = None
    noise: float = 1.0
    support: tuple[int, ...] | None = None
    max_length: int = 4096
    tokenizer_id: str | None = "synthetic"
    capabilities: frozenset[Capability] = frozenset()

    def logits_for(self, context: Sequence[int]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, *context)) & 0x7FFF_FFFF_FFFF_FFFF)
        logits = self.sharpness * torch.randn(self.vocab_size, generator=generator)  # [V]
        if self.base is not None:
            logits = self.base.logits_for(context) + self.noise * logits
        if self.support is not None:
            mask = torch.full((self.vocab_size,), float("-inf"))
            mask[list(self.support)] = 0.0
            logits = logits + mask
        return logits

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> TokenCache:
        return TokenCache(capacity)  # positions play no part in a synthetic model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: TokenCache, num_logits: int) -> torch.Tensor:
        rows = []
        for i, (token, position) in enumerate(zip(tokens.tolist(), positions.tolist())):
            cache.append(token, position)
            if i >= len(tokens) - num_logits:
                rows.append(self.logits_for(cache.visible()))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)  # [num_logits, V]


def greedy_decode(model: SyntheticLM, prompt: Sequence[int], max_new_tokens: int, stop_tokens: Sequence[int] = ()) -> list[int]:
    """Plain argmax decoding with the full context: the reference for greedy losslessness."""
    out: list[int] = []
    while len(out) < max_new_tokens:
        out.append(int(model.logits_for([*prompt, *out]).argmax()))
        if out[-1] in stop_tokens:
            break
    return out


def sequence_probabilities(
    model: SyntheticLM, prompt: Sequence[int], length: int, sampling: SamplingConfig, stop_tokens: Sequence[int] = ()
) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of ``prompt`` of ``length`` tokens (shorter if it ends
    in a stop token), under ``warp(model logits)`` with the full context."""
    result: dict[tuple[int, ...], float] = {(): 1.0}
    finished: dict[tuple[int, ...], float] = {}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for seq, prob in result.items():
            probs = warp(model.logits_for([*prompt, *seq]), sampling)  # [V]
            for token in torch.nonzero(probs).flatten().tolist():
                target = finished if token in stop_tokens else grown
                target[(*seq, token)] = prob * float(probs[token])
        result = grown
    return {**result, **finished}

