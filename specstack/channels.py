"""Named channels between levels, so that no level reaches into another level's cache.

A gathering cache policy (TriForce's retrieval, the Top-K oracle) builds its level's view out of the
full KV cache of the same model one level up. What it may read of that level is exactly this:

* the committed keys (``gather`` scores them), or the mean key of each of their chunks, kept
  running as the cache grows (:class:`ChunkMeans`; a policy that scores chunks, :class:`ScoresChunks`),
* the query of the last committed token of each layer (retrieval scores chunks with it),
* a copy of chosen entries into its own store.

:class:`FullCacheChannel` is that channel; the full-cache level opens it
(:meth:`~specstack.model.CachedModel.open_channel`) and logs its queries into a :class:`QueryLog`.

A drafter that reads the hidden states of the level it drafts for (Medusa's heads) reads them
through a :class:`HiddenStateChannel`, which that level opens
(:meth:`~specstack.model.CachedModel.open_hidden_channel`) and fills through a :class:`HiddenLog`:
the last hidden state of each recently scored position, and the level's own output head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import attrs
import torch

from .errors import SpecstackError

if TYPE_CHECKING:
    from .model import CachedModel, KVCache
    from .policies import GatheringPolicy

HIDDEN_ROOM = 256  # positions a HiddenLog remembers (a ring): a few rounds of any level

MEAN_BLOCK = 1 << 22  # key elements turned into float32 at once when chunk means are computed (16 MiB)


@attrs.define(eq=False)
class QueryLog:
    """The query [Hq, D] of the last committed token fed to a level, per layer."""

    queries: torch.Tensor | None = None  # [L, Hq, D]

    def record(self, layer: int, layers: int, query: torch.Tensor) -> None:
        self.log(layers, *query.shape, query.dtype, query.device)[layer] = query  # query [Hq, D]

    def log(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The log [L, Hq, D] each layer's query is written into (new where it held queries of another shape or dtype)."""
        if self.queries is None or self.queries.shape[1:] != (heads, dim) or self.queries.dtype != dtype:
            self.queries = torch.zeros(layers, heads, dim, dtype=dtype, device=device)  # [L, Hq, D]
        return self.queries


@runtime_checkable
class ScoresChunks(Protocol):
    """A gathering policy that reads the committed keys only through the mean key of each chunk of
    ``chunk_size`` positions (TriForce's retrieval): the channel keeps those means running."""

    chunk_size: int

    def gather_chunks(self, means: torch.Tensor, queries: torch.Tensor, context: int) -> torch.Tensor:
        """Slots to gather ([L, H, K] or [K]) from the chunk means [L, H, context // chunk_size, D] and
        the last query of each layer [L, Hq, D]."""


def chunk_means(keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, H, n, D] keys -> [L, H, n // chunk_size, D] float32: the mean key of each complete chunk."""
    layers, heads, length, dim = keys.shape
    chunks = length // chunk_size
    means = torch.empty(layers, heads, chunks, dim, dtype=torch.float32, device=keys.device)  # [L, H, C, D]
    _mean_into(means, keys[:, :, : chunks * chunk_size], chunk_size)
    return means


def _mean_into(out: torch.Tensor, keys: torch.Tensor, chunk_size: int) -> None:
    """Write the chunk means of ``keys`` [L, H, c*S, D] into ``out`` [L, H, c, D], a few layers at a time
    so that the float32 copy stays small (each mean is the same sum however the layers are split)."""
    layers, heads, length, dim = keys.shape
    step = max(1, MEAN_BLOCK // max(1, heads * length * dim))
    for first in range(0, layers, step):
        block = keys[first : first + step]  # [l, H, c*S, D]
        chunks = block.reshape(block.shape[0], heads, length // chunk_size, chunk_size, dim)  # [l, H, c, S, D]
        out[first : first + step] = chunks.float().mean(3)  # [l, H, c, D]


@attrs.define(eq=False)
class ChunkMeans:
    """The mean key of each complete chunk of a full cache's leading positions, kept as it grows:
    ``update`` computes only the chunks not yet known or written since the last call.

    ``room`` bounds the chunks ever held (the full cache's capacity over ``chunk_size``); the buffer
    grows by doubling up to it. ``computed`` counts chunks computed since creation."""

    chunk_size: int
    room: int
    means: torch.Tensor | None = attrs.field(init=False, default=None)  # [L, H, allocated, D] float32
    known: int = attrs.field(init=False, default=0)  # leading chunks whose means are current
    computed: int = attrs.field(init=False, default=0)

    def update(self, keys: torch.Tensor, unchanged: int) -> torch.Tensor:
        """The means [L, H, h // S, D] of ``keys`` [L, H, h, D], whose first ``unchanged`` positions are
        the same as at the last call."""
        total = keys.shape[2] // self.chunk_size
        self._make_room(keys, total)
        valid = max(0, min(self.known, unchanged // self.chunk_size))
        if total > valid:
            _mean_into(self.means[:, :, valid:total], keys[:, :, valid * self.chunk_size : total * self.chunk_size], self.chunk_size)
            self.computed += total - valid
        self.known = max(valid, total)
        return self.means[:, :, :total]  # [L, H, C, D]

    def _make_room(self, keys: torch.Tensor, total: int) -> None:
        layers, heads, _, dim = keys.shape
        means = self.means
        if means is not None and (means.shape[:2], means.shape[3], means.device) != ((layers, heads), dim, keys.device):
            means, self.known = None, 0  # another cache's shape: start over
        if means is not None and means.shape[2] >= total:
            return
        size = max(total, min(self.room, 2 * (means.shape[2] if means is not None else 0)))
        self.means = torch.empty(layers, heads, size, dim, dtype=torch.float32, device=keys.device)  # [L, H, size, D]
        if means is not None:
            self.means[:, :, : self.known] = means[:, :, : self.known]


@attrs.define(eq=False)
class FullCacheChannel:
    """What a gathering level reads of the full-cache level of the same model above it."""

    _source: "CachedModel"
    queries: QueryLog
    _means: ChunkMeans | None = attrs.field(init=False, default=None)
    _writes: int = attrs.field(init=False, default=0)  # the source's forward_tokens when the means were last brought up to date

    def horizon(self, context: Sequence[int]) -> int:
        """How many leading ``context`` tokens the full cache holds, after letting it catch up when it
        lags by more than one token (e.g. at the prompt). An empty context has nothing to hold."""
        if len(context) == 0:
            return 0
        horizon = self._source.fed_prefix(context)
        if horizon < len(context) - 1 or horizon == 0:
            self._source.logits(context, 1)
            horizon = self._source.fed_prefix(context)
        return horizon

    def caught_up(self, context: Sequence[int]) -> bool:
        """Whether the full cache holds ``context`` but for its last token at most, so that a gather now
        costs the full-cache level no forward of its own: at the start of each of its rounds."""
        return self._source.fed_prefix(context) >= len(context) - 1

    def keys(self, horizon: int) -> torch.Tensor:
        """[L, H, horizon, D] the committed keys."""
        return self._source.cache.keys_before(horizon)

    def chunk_means(self, chunk_size: int, horizon: int) -> torch.Tensor:
        """[L, H, horizon // chunk_size, D] float32: the mean committed key of each complete chunk below
        ``horizon``. Only chunks not computed before, or written since, are computed: every write to the
        full cache is a forward pass of its level, which counts the tokens it writes, so after W tokens
        written into a cache now n long, its first n - W slots are untouched."""
        writes = self._source.stats.forward_tokens
        unchanged = len(self._source.cache) - (writes - self._writes) if writes >= self._writes else 0
        if self._means is None or self._means.chunk_size != chunk_size:
            self._means = ChunkMeans(chunk_size=chunk_size, room=self._source.capacity // chunk_size)
        self._writes = writes
        return self._means.update(self.keys(horizon), unchanged)  # [L, H, C, D]

    def gather(self, policy: "GatheringPolicy", horizon: int) -> torch.Tensor:
        """The slots ``policy`` gathers below ``horizon``: a :class:`ScoresChunks` policy scores the
        running chunk means, any other gathering policy the committed keys."""
        if isinstance(policy, ScoresChunks):
            return policy.gather_chunks(self.chunk_means(policy.chunk_size, horizon), self.queries.queries, horizon)
        return policy.gather(self.keys(horizon), self.queries.queries)

    def copy_into(self, store: "KVCache", slots: torch.Tensor, horizon: int) -> None:
        """Fill ``store`` with the full cache's entries at ``slots`` ([K] or [L, H, K])."""
        store.gather_from(self._source.cache, slots, horizon)


@attrs.define(eq=False)
class HiddenLog:
    """The last hidden state (after the final norm, what the output head reads) of the recently scored
    positions of one level, in a ring of ``room`` positions: O(1) memory in the context.

    A forward that writes positions from ``start`` on makes every state at ``start`` or later stale
    (``forget_from``), then ``record``s the states of the rows it scored, and of its last ``recent`` rows."""

    room: int = HIDDEN_ROOM
    recent: int = 0  # the level logs the states of the last `recent` rows of every forward, beyond the rows it scores
    _positions: torch.Tensor = attrs.field(init=False)  # [room] int64 on the host: the position held in each slot, -1: none
    _states: torch.Tensor | None = attrs.field(init=False, default=None)  # [room, H]

    def __attrs_post_init__(self) -> None:
        self._positions = torch.full((self.room,), -1, dtype=torch.long, device="cpu")  # [room]

    def forget_from(self, position: int) -> None:
        self._positions.masked_fill_(self._positions >= position, -1)

    def record(self, positions: torch.Tensor, states: torch.Tensor) -> None:
        """``states`` [n, H] of the rows at ``positions`` [n] (host)."""
        if self._states is None or self._states.shape[1:] != states.shape[1:] or self._states.device != states.device:
            self._states = torch.zeros(self.room, *states.shape[1:], dtype=states.dtype, device=states.device)  # [room, H]
            self._positions.fill_(-1)
        positions, states = positions[-self.room :].cpu(), states[-self.room :]  # a ring keeps the last room of them
        slots = positions % self.room  # [n]
        self._positions[slots] = positions
        self._states[slots.to(states.device)] = states

    def at(self, position: int) -> torch.Tensor | None:
        """[H] the state of ``position``, or None if it is not held."""
        slot = position % self.room
        return self._states[slot].clone() if position >= 0 and int(self._positions[slot]) == position else None  # [H], not a view of the ring

    def run(self, start: int, stop: int) -> tuple[int, torch.Tensor | None]:
        """(first, states [stop - first, H]) of the longest run of held positions that ends at ``stop`` - 1 and
        starts at ``start`` or later; (stop, None) when ``stop`` - 1 is not held."""
        start = max(start, stop - self.room, 0)
        positions = torch.arange(start, stop)  # [n]
        held = (self._positions[positions % self.room] == positions).flip(0)  # [n], from stop - 1 back
        missing = torch.nonzero(~held)
        first = stop - (int(missing[0]) if missing.numel() else positions.shape[0])
        if first == stop or self._states is None:
            return stop, None
        return first, self._states[(torch.arange(first, stop) % self.room).to(self._states.device)]  # [stop - first, H]


@attrs.define(eq=False)
class HiddenStateChannel:
    """What a drafter reads of the level it drafts for: the hidden state of the last positions that
    level committed, and that level's output head and input embedding (Medusa's heads end in the
    target's own LM head; heads with token input read its embedding of a token)."""

    _source: "CachedModel"
    log: HiddenLog

    @property
    def hidden_size(self) -> int:
        return int(self._source.model.hidden_size)

    @property
    def device(self) -> torch.device:
        return self._source.device

    def latest(self, prefix: Sequence[int]) -> tuple[int, torch.Tensor] | None:
        """(q, state [H]) for the latest position q of ``prefix`` whose state the level holds, among
        the last two (the last token is usually the one the level emitted, not yet fed: then q is
        ``len(prefix) - 2``, whose state predicted it). None when neither is held: the level has not
        scored this prefix (a cache adopted from another stack, the level above rejected its tokens)."""
        held = self._source.fed_prefix(prefix)
        for q in (len(prefix) - 1, len(prefix) - 2):
            state = self.log.at(q) if 0 <= q < held else None
            if state is not None:
                return q, state
        return None

    def keep_recent(self, rows: int) -> None:
        """Ask the level to log the states of the last ``rows`` rows of each of its forwards, a prompt's prefill
        included, not only of the rows it scores (a drafter that reads the states of every committed position)."""
        if not 0 <= rows <= self.log.room:
            raise SpecstackError(f"a hidden-state channel keeps the states of at most {self.log.room} recent rows; {rows} asked")
        self.log.recent = max(self.log.recent, rows)

    def run(self, prefix: Sequence[int], start: int, stop: int) -> tuple[int, torch.Tensor | None]:
        """(first, states [stop - first, H]): the states of positions ``first`` … ``stop`` - 1 of ``prefix``, the
        longest run ending at ``stop`` - 1 that the level holds from ``start`` on (an EAGLE draft reads every
        committed position's state); (stop, None) when it does not hold ``stop`` - 1."""
        if self._source.fed_prefix(prefix) < stop:
            return stop, None
        return self.log.run(start, stop)

    def output_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[n, H] hidden states -> [n, V] float32 logits through the level's own output head."""
        return self._source.model.output_logits(states)

    def output_head(self, rows: torch.Tensor):
        """The level's output head for the token ids ``rows`` [R] only: a function [n, H] -> [n, R] float32
        logits (a drafter that drafts from a smaller vocabulary builds it once)."""
        return self._source.model.output_head(rows)

    def input_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, H] the level's own input embeddings of them."""
        return self._source.model.input_embeddings(tokens)
