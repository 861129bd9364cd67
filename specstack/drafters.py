"""Drafters: anything that proposes tokens together with the distribution it drew them from.

:class:`ModelDrafter` samples autoregressively from a model; :class:`PromptLookupDrafter` copies the
continuation of an earlier occurrence of the last few tokens (free, and strong on long repetitive
contexts). A stack level that verifies a drafter is itself a drafter (:class:`specstack.stack.SpeculativeLevel`).
"""

from __future__ import annotations

import abc
from typing import ClassVar, Sequence

import attrs
import numpy as np
import torch

from .errors import SpecstackError
from .model import CachedModel
from .sampling import SamplingConfig, sample, warp
from .types import Capability, Draft, DraftKind, LevelStats


class Drafter(abc.ABC):
    """Proposes continuations of a token sequence.

    ``propose(prefix, n)`` returns a :class:`Draft` of (about) ``n`` tokens continuing ``prefix``, each
    with the distribution it was drawn from; fewer when a stop token was drafted or nothing could be
    proposed. ``step`` is the number of tokens the drafter naturally produces per call.

    ``draft_kind`` says how its drafts are drawn (a chain, or a token tree with or without
    replacement, or a deterministic one; :class:`~specstack.types.DraftKind`): the stack picks a
    verifier that verifies that kind losslessly. A tree drafter's ``propose(prefix, n)`` returns a tree
    of depth at most ``n``. ``requires`` lists what the *verifying* level's model must provide.
    """

    name: ClassVar[str]
    requires: ClassVar[frozenset[Capability]] = frozenset()
    draft_kind: DraftKind = DraftKind.CHAIN
    step: int = 1

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @abc.abstractmethod
    def propose(self, prefix: Sequence[int], n: int) -> Draft: ...

    @abc.abstractmethod
    def level_stats(self) -> list[LevelStats]:
        """Counters of this drafter and of every level below it, lowest level first."""

    def reset(self) -> None:
        """Forget all cached state (called at the start of each generation)."""

    def prefill(self, prompt: Sequence[int]) -> None:
        """Process the prompt ahead of decoding (optional: drafting catches up lazily anyway)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """How the level above judged this drafter's last draft (used by refreshable caches)."""


@attrs.define(eq=False, kw_only=True)
class ModelLevel(Drafter):
    """A drafter backed by a model over its own cache view, sampling with the stack's settings."""

    lm: CachedModel
    sampling: SamplingConfig
    generator: torch.Generator
    stop_tokens: frozenset[int] = frozenset()

    @property
    def vocab_size(self) -> int:
        return self.lm.model.vocab_size

    def observe(self, drafted: int, accepted: int) -> None:
        self.lm.observe(drafted, accepted)

    def level_stats(self) -> list[LevelStats]:
        return [self.lm.stats]  # a level with levels below it adds theirs

    def reset(self) -> None:
        self.lm.reset()

    def prefill(self, prompt: Sequence[int]) -> None:
        self.lm.logits(prompt, 1)


@attrs.define(eq=False, kw_only=True)
class ModelDrafter(ModelLevel):
    """Autoregressive sampling from a model over its cache view: level 0 of most stacks, and the
    whole of a depth-1 (plain autoregressive) stack."""

    name: ClassVar[str] = "model"

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        context, rows = list(prefix), []
        for _ in range(n):
            probs = warp(self.lm.logits(context, 1)[0], self.sampling)  # [V]
            context.append(sample(probs, self.generator))
            rows.append(probs)
            if context[-1] in self.stop_tokens:
                break
        self.lm.stats.drafted += len(rows)
        probs = torch.stack(rows)  # [k, V] on this level's device
        return Draft(tokens=torch.tensor(context[len(prefix) :], dtype=torch.long, device=probs.device), probs=probs)


@attrs.define(eq=False, kw_only=True)
class PromptLookupDrafter(Drafter):
    """Prompt-lookup (n-gram) drafting (Saxena, 2023): find the latest earlier occurrence of the last
    ``max_ngram`` … ``min_ngram`` tokens and propose what followed it. Deterministic, so the proposal
    distribution is one-hot; when nothing matches the draft is empty and the level above samples on
    its own."""

    name: ClassVar[str] = "prompt-lookup"

    vocab: int
    max_ngram: int = 3
    min_ngram: int = 1
    stats: LevelStats = attrs.field(factory=lambda: LevelStats(name="prompt-lookup"))

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecstackError(f"n-gram range {self.min_ngram}..{self.max_ngram} is not allowed; need 1 <= min_ngram <= max_ngram")

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        tokens = self._lookup(np.asarray(prefix, dtype=np.int64), n)
        self.stats.drafted += len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device="cpu")  # [k]; model-free: the verifying level moves it
        probs = torch.zeros(len(tokens), self.vocab, device="cpu").scatter_(1, ids[:, None], 1.0)  # [k, V]
        return Draft(tokens=ids, probs=probs)

    def _lookup(self, seq: np.ndarray, n: int) -> list[int]:
        for size in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], size)  # [L-size, size]
            hits = np.flatnonzero((windows == seq[-size:]).all(axis=1))
            if hits.size:
                start = hits[-1] + size
                return seq[start : start + n].tolist()
        return []

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]
