"""Cache policies: which KV positions a level attends to.

There are two kinds, each with one narrow method; the KV store and :class:`~specstack.model.CachedModel`
own the mechanics (writing, gathering, copying, rolling back):

* an :class:`EvictionPolicy` manages the level's own cache: ``select`` says which slots to keep
  whenever the next forward pass would not fit (full, StreamingLLM, H2O);
* a :class:`GatheringPolicy` builds the level's view out of the full cache of the same model one
  level up: ``gather`` says which of its entries to copy, per layer and KV head (TriForce's
  retrieval cache, the Top-K oracle). Tokens after the gather are appended behind the gathered ones.
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
    ``cache`` is the level's cache object, for policies that declared capabilities such as
    ``Capability.KEYS`` and read them from it.
    """

    positions: torch.Tensor  # [n]
    capacity: int
    incoming: int
    cache: Any = None

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


class EvictionPolicy(CachePolicy):
    """A policy over the level's own cache: ``select(state)`` returns the slots to keep
    ([K] long tensor, ascending, unique, K <= ``state.room``)."""

    @abc.abstractmethod
    def select(self, state: CacheState) -> torch.Tensor:
        ...


class GatheringPolicy(CachePolicy):
    """A view gathered from the full cache of the same model.

    ``gather(keys, queries)`` gets the full cache's keys [L, H, h, D] for the h positions known to be
    committed and the last query of each layer [L, Hq, D]; it returns source slots [L, H, K] (each
    row ascending, unique). ``needs_refresh(appended, acceptance)`` says whether to gather again, given
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
        return torch.arange(state.positions.shape[0])  # [n]; never evicts


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpecstackError(f"{name} {value!r} is not allowed; use an integer >= {minimum}")
    return value


class StreamingLLM(EvictionPolicy):
    """Attention sinks plus a recent window (Xiao et al., 2024, "Efficient Streaming Language
    Models with Attention Sinks").

    Keeps the first ``sinks`` positions and the most recent ones, ``sinks + window`` slots in all.
    With ``relative_positions`` (the default, as in the paper) rotary positions are positions inside
    the cache, so a small draft never sees positions beyond its trained context.
    """

    name = "streaming"

    def __init__(self, *, sinks: int = 16, window: int = 256, relative_positions: bool = True) -> None:
        self.sinks = _positive_int("sinks", sinks, minimum=0)
        self.window = _positive_int("window", window, minimum=2)
        self.relative_positions = bool(relative_positions)

    def capacity(self, max_length: int) -> int:
        return min(max_length, self.sinks + self.window)

    def select(self, state: CacheState) -> torch.Tensor:
        n = state.positions.shape[0]
        sinks = min(self.sinks, n, state.room)
        recent = max(0, state.room - sinks)
        return torch.cat([torch.arange(sinks), torch.arange(max(sinks, n - recent), n)])  # [K]


def check_selection(policy: EvictionPolicy, keep: torch.Tensor, state: CacheState) -> torch.Tensor:
    """Enforce the contract of :meth:`CachePolicy.select`; raise a one-line error naming the policy."""
    n = state.positions.shape[0]
    problem = None
    if keep.dim() != 1 or keep.dtype != torch.long:
        problem = f"returned a {keep.dtype} tensor of shape {tuple(keep.shape)}, expected a 1-D long tensor"
    elif keep.numel() > state.room:
        problem = f"kept {keep.numel()} slots but only {state.room} fit (capacity {state.capacity}, incoming {state.incoming})"
    elif keep.numel() and (keep[0] < 0 or keep[-1] >= n):
        problem = f"returned slots outside [0, {n})"
    elif keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
        problem = "returned slots that are not strictly ascending"
    if problem:
        raise SpecstackError(f"cache policy '{policy.name}' {problem}")
    return keep
