"""Cache policies: which KV positions a level attends to.

There are two kinds, each with one narrow method; the KV store and :class:`~specstack.model.CachedModel`
own the mechanics (writing, gathering, copying, rolling back):

* an :class:`EvictionPolicy` manages the level's own cache: ``select`` says which slots to keep
  whenever the next forward pass would not fit (full, StreamingLLM, H2O);
* a :class:`GatheringPolicy` builds the level's view out of the full cache of the same model one
  level up: ``gather`` says which of its entries to copy, per layer and KV head (TriForce's
  retrieval cache, the Top-K oracle). Tokens after the gather are appended behind the gathered ones.

A policy that declares ``Capability.SPARSE_ATTENTION`` also restricts, query by query, which of the
view's slots each new token attends to (:meth:`CachePolicy.attend`, the Top-K oracle).

Every policy that does not keep everything takes a ``budget`` keyword: the number of KV entries per
layer and head it attends to, so that policies can be compared at equal budgets.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import attrs
import torch

from .errors import SpecstackError
from .types import Capability


@attrs.frozen(kw_only=True, eq=False)
class CacheState:
    """What a policy sees when it must make room.

    ``positions`` [n] are the sequence positions held by the occupied slots, ascending. After the
    policy's selection the cache must take ``incoming`` more tokens without exceeding ``capacity``.
    ``attention`` [L, H, n] is the attention mass each slot has received, per layer and KV head, for
    policies that declared ``Capability.ATTENTION_WEIGHTS`` (None otherwise). Slots holding a
    different position in each head (after a per-head eviction) have position -1.
    """

    positions: torch.Tensor  # [n]
    capacity: int
    incoming: int
    attention: torch.Tensor | None = None  # [L, H, n]

    @property
    def room(self) -> int:
        """The largest number of slots the selection may keep."""
        return self.capacity - self.incoming


class CachePolicy(abc.ABC):
    """Decides what a level attends to.

    Subclasses set ``name`` (the registry name) and may declare ``requires`` (capabilities the model
    must provide). ``capacity(max_length)`` is the number of slots the level's cache holds.
    ``relative_positions`` asks for rotary positions inside the cache rather than in the sequence.
    Rejected speculative tokens are rolled back by the cache, never by the policy.
    """

    name: ClassVar[str]
    requires: ClassVar[frozenset[Capability]] = frozenset()
    gathers_from_full: ClassVar[bool] = False
    complete: ClassVar[bool] = False  # attends to every position (a valid source for gathering policies)
    relative_positions: bool = False

    def capacity(self, max_length: int) -> int:
        return max_length

    def attend(self, weights: torch.Tensor) -> torch.Tensor:
        """With ``Capability.SPARSE_ATTENTION``: the slots each new token may attend to, given its
        attention weights [H, T, n] pooled over the query heads of each KV head ([H, T, n] bool)."""
        raise NotImplementedError(f"cache policy '{self.name}' declares no sparse attention")


class EvictionPolicy(CachePolicy):
    """A policy over the level's own cache: ``select(state)`` returns the slots to keep, ascending and
    unique, at most ``state.room`` of them: [K] for all layers and heads, or [L, H, K] per layer and
    KV head. Per-head rows must end in the same slots (say, a recent window), because a rollback is
    a move of the length pointer over those shared slots."""

    @abc.abstractmethod
    def select(self, state: CacheState) -> torch.Tensor:
        ...


class GatheringPolicy(CachePolicy):
    """A view gathered from the full cache of the same model.

    ``gather(keys, queries)`` gets the full cache's keys [L, H, h, D] for the h positions known to be
    committed and the last query of each layer [L, Hq, D]; it returns source slots [L, H, K] (each
    row ascending, unique), or [K] for the same slots everywhere. ``needs_refresh(appended, acceptance)`` says whether to gather again, given
    the tokens appended since the last gather and the rolling acceptance of this level's drafts.
    """

    gathers_from_full = True
    requires = frozenset({Capability.KEYS, Capability.QUERIES})

    @abc.abstractmethod
    def gather(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        ...

    def needs_refresh(self, appended: int, acceptance: float | None) -> bool:
        return False


class FullCache(EvictionPolicy):
    """Attend to everything: the target's own distribution."""

    name = "full"
    complete = True

    def select(self, state: CacheState) -> torch.Tensor:
        return torch.arange(state.positions.shape[0], device=state.positions.device)  # [n]; never evicts


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpecstackError(f"{name} {value!r} is not allowed; use an integer >= {minimum}")
    return value


class StreamingLLM(EvictionPolicy):
    """Attention sinks plus a recent window (Xiao et al., 2024, "Efficient Streaming Language
    Models with Attention Sinks").

    Keeps the first ``sinks`` positions and the most recent ones, ``sinks + window`` slots in all
    (``budget``, if given, sets the window to ``budget - sinks``). With ``relative_positions`` (the
    default, as in the paper) rotary positions are positions inside the cache, so a small draft never
    sees positions beyond its trained context.

    Eviction has hysteresis, like H2O's ``reserve``: when the window is full, it is cut down to its
    ``window - reserve`` most recent tokens, so the next ``reserve`` tokens are written without
    evicting. The paper evicts one token per token (``reserve=1``); every eviction moves the whole
    window down, which with cache-relative positions re-rotates every moved key, O(window) work. With
    a reserve that work happens once per ``reserve`` tokens, and the price is a window that varies
    between ``window - reserve`` and ``window`` recent tokens. The default, ``min(16, window // 4)``
    (at least 1), costs a 256-token window at most 6% of its tokens for 16x fewer evictions.
    """

    name = "streaming"

    def __init__(self, *, sinks: int = 16, window: int = 256, budget: int | None = None, relative_positions: bool = True,
                 reserve: int | None = None) -> None:
        self.sinks = _positive_int("sinks", sinks, minimum=0)
        if budget is not None:
            if not isinstance(budget, int) or budget < self.sinks + 2:
                raise SpecstackError(f"streaming budget {budget!r} is not allowed; use an integer >= {self.sinks + 2} ({self.sinks} sinks + a window of at least 2)")
            window = budget - self.sinks
        self.window = _positive_int("window", window, minimum=2)
        self.reserve = max(1, min(16, self.window // 4)) if reserve is None else _positive_int("reserve", reserve)
        if self.reserve >= self.window:
            raise SpecstackError(f"streaming reserve {reserve!r} is not allowed with a window of {self.window}; use an integer in [1, {self.window - 1}]")
        self.relative_positions = bool(relative_positions)

    def capacity(self, max_length: int) -> int:
        return min(max_length, self.sinks + self.window)

    def select(self, state: CacheState) -> torch.Tensor:
        n = state.positions.shape[0]
        sinks = min(self.sinks, n, state.room)
        recent = max(0, min(state.room - sinks, self.window - self.reserve))  # room for `reserve` more tokens after these
        device = state.positions.device
        return torch.cat([torch.arange(sinks, device=device), torch.arange(max(sinks, n - recent), n, device=device)])  # [K]


def check_selection(policy: EvictionPolicy, keep: torch.Tensor, state: CacheState) -> torch.Tensor:
    """Enforce the contract of :meth:`EvictionPolicy.select`; raise a one-line error naming the policy."""
    n = state.positions.shape[0]
    rows = keep.reshape(-1, keep.shape[-1]) if keep.dim() in (1, 3) and keep.numel() else keep  # [rows, K]
    problem = None
    if keep.dim() not in (1, 3) or keep.dtype != torch.long:
        problem = f"returned a {keep.dtype} tensor of shape {tuple(keep.shape)}, expected [K] or [L, H, K] long"
    elif keep.shape[-1] > state.room:
        problem = f"kept {keep.shape[-1]} slots but only {state.room} fit (capacity {state.capacity}, incoming {state.incoming})"
    elif keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n):
        problem = f"returned slots outside [0, {n})"
    elif keep.shape[-1] > 1 and not bool((rows[:, 1:] > rows[:, :-1]).all()):
        problem = "returned slots that are not strictly ascending"
    if problem:
        raise SpecstackError(f"cache policy '{policy.name}' {problem}")
    return keep
