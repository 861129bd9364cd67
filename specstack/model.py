"""The model protocol and :class:`CachedModel`, a model bound to one level's cache view.

A model is anything with this small surface (see :class:`CausalLM`): tokens and their positions in,
logits out, appending to a cache it created. The synthetic models of :mod:`specstack.synthetic`
and the transformers-backed models implement it.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence, runtime_checkable

import attrs
import torch

from .errors import SpecstackError
from .policies import CachePolicy, CacheState, check_selection
from .types import Capability, LevelStats


@runtime_checkable
class KVCache(Protocol):
    """Preallocated per-level storage. Slots hold ascending sequence positions."""

    positions: torch.Tensor  # [n] positions of the occupied slots
    records_attention: bool  # accumulate attention mass per slot (Capability.ATTENTION_WEIGHTS)
    attention_filter: object  # None, or the policy's ``attend`` (Capability.SPARSE_ATTENTION)

    def __len__(self) -> int: ...

    def attention_mass(self) -> torch.Tensor:
        """[L, H, n]: attention received by each occupied slot since it was written."""

    def truncate(self, position: int) -> None:
        """Drop every slot whose position is >= ``position`` (O(1): moves a length pointer)."""

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only ``slots`` (ascending), moving them to the front."""


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as a stack sees it."""

    vocab_size: int
    max_length: int  # the model's context window
    capabilities: frozenset[Capability]
    tokenizer_id: str | None  # identifies the tokenizer; levels of one stack must agree

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> KVCache:
        """A fresh, empty cache with room for ``capacity`` slots; with ``relative_positions`` rotary
        positions are slot indices (keys are re-rotated when slots move)."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, num_logits: int) -> torch.Tensor:
        """Append ``tokens`` [T] at ``positions`` [T] to ``cache`` and return the logits of the last
        ``num_logits`` of them ([num_logits, V]); each token attends to the cache and the tokens before it."""


@attrs.define(eq=False)
class CachedModel:
    """A model plus the cache view of one level, kept in step with a token sequence.

    ``logits(tokens, n)`` returns the logits predicting the last ``n`` positions of ``tokens``. The
    cache is first rolled back to the longest prefix it already holds (a pointer move), then the
    remaining tokens are fed, in chunks when the policy has to evict on the way.
    """

    model: CausalLM
    policy: CachePolicy
    stats: LevelStats
    source: "CachedModel | None" = None  # the full-cache level a gathering policy reads from
    capacity: int = attrs.field(init=False)
    cache: KVCache = attrs.field(init=False)
    _fed: list[int] = attrs.field(init=False, factory=list)  # token at every position fed so far
    _acceptance: float | None = attrs.field(init=False, default=None)  # rolling, of this level's drafts

    def __attrs_post_init__(self) -> None:
        self.capacity = self.policy.capacity(self.model.max_length)
        self.cache = self.model.new_cache(self.capacity, relative_positions=self.policy.relative_positions)
        self.cache.records_attention = Capability.ATTENTION_WEIGHTS in self.policy.requires
        if Capability.SPARSE_ATTENTION in self.policy.requires:
            self.cache.attention_filter = self.policy.attend
        if self.policy.gathers_from_full:
            if self.source is None:
                raise SpecstackError(f"cache policy '{self.policy.name}' needs a full-cache level of the same model above it")
            self.source.cache.records_queries = True

    def reset(self) -> None:
        self.cache.truncate(0)
        self._fed.clear()
        self._acceptance = None

    def observe(self, drafted: int, accepted: int, decay: float = 0.8) -> None:
        """Record how the level above judged this level's draft (a rolling acceptance rate)."""
        if drafted:
            rate = accepted / drafted
            self._acceptance = rate if self._acceptance is None else decay * self._acceptance + (1 - decay) * rate

    def fed_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` this level's cache has already seen."""
        limit = min(len(self._fed), len(tokens))
        return limit if self._fed[:limit] == list(tokens[:limit]) else _common_prefix(self._fed, tokens, limit)

    def logits(self, tokens: Sequence[int], num_logits: int) -> torch.Tensor:
        if self.policy.gathers_from_full:
            self._gather_if_due(tokens, num_logits)
        start = self._rollback(tokens, num_logits)
        rows = []
        while start < len(tokens):
            size = self._chunk(len(tokens) - start)
            wanted = max(0, min(size, num_logits - (len(tokens) - start - size)))
            rows.append(self._forward(tokens[start : start + size], start, wanted))
            start += size
        return torch.cat([r for r in rows if r.shape[0]])  # [num_logits, V]

    def _rollback(self, tokens: Sequence[int], num_logits: int) -> int:
        """Roll the cache back to the longest prefix of ``tokens`` it holds, leaving ``num_logits`` to feed."""
        start = self.fed_prefix(tokens[: len(tokens) - num_logits])
        self.cache.truncate(start)
        if len(self.cache) == 0:  # the rollback reached into evicted or per-head slots: start over
            start = 0
        del self._fed[start:]
        return start

    def _gather_if_due(self, tokens: Sequence[int], num_logits: int) -> None:
        """Rebuild this level's view from the source's full cache when the policy asks for it."""
        context = tokens[: len(tokens) - num_logits]
        seen = self.fed_prefix(tokens)  # one comparison serves all three checks below
        appended = min(seen, len(context)) - self.cache.horizon
        stale = self.cache.horizon == 0 or appended < 0
        out_of_room = len(self.cache) + len(tokens) - seen > self.capacity
        if not (stale or out_of_room or self.policy.needs_refresh(appended, self._acceptance)):
            return
        horizon = self.source.fed_prefix(context)
        if horizon < len(context) - 1 or horizon == 0:  # the source lags (e.g. at the prompt): let it catch up
            self.source.logits(context, 1)
            horizon = self.source.fed_prefix(context)
        slots = self.policy.gather(self.source.cache.keys[:, :, :horizon], self.source.cache.last_queries)
        self.cache.gather_from(self.source.cache, slots, horizon)
        self._fed[:] = list(context[:horizon])
        self.stats.gathers += 1

    def _chunk(self, remaining: int) -> int:
        if len(self.cache) + remaining <= self.capacity:
            return remaining
        return max(1, min(remaining, self.capacity // 4))

    def _forward(self, tokens: Sequence[int], start: int, num_logits: int) -> torch.Tensor:
        self._make_room(len(tokens))
        began = time.perf_counter()
        ids = torch.tensor(tokens, dtype=torch.long)  # [T]
        positions = torch.arange(start, start + len(tokens))  # [T]
        out = self.model.forward(ids, positions, self.cache, num_logits)  # [num_logits, V]
        self._fed.extend(tokens)
        self.stats.forward_calls += 1
        self.stats.forward_tokens += len(tokens)
        self.stats.forward_seconds += time.perf_counter() - began
        return out

    def _make_room(self, incoming: int) -> None:
        if len(self.cache) + incoming <= self.capacity:
            return
        attention = self.cache.attention_mass() if self.cache.records_attention else None  # [L, H, n]
        state = CacheState(positions=self.cache.positions, capacity=self.capacity, incoming=incoming, attention=attention)
        self.cache.keep(check_selection(self.policy, self.policy.select(state), state))


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


def check_window(model: CausalLM, needed: int, what: str) -> None:
    if needed > model.max_length:
        raise SpecstackError(f"{what} needs {needed} positions but the model's window is {model.max_length}; shorten the prompt or max_new_tokens")
