"""Named channels between levels, so that no level reaches into another level's cache.

A gathering cache policy (TriForce's retrieval, the Top-K oracle) builds its level's view out of the
full KV cache of the same model one level up. What it may read of that level is exactly this:

* the committed keys (``gather`` scores them),
* the query of the last committed token of each layer (retrieval scores chunks with it),
* a copy of chosen entries into its own store.

:class:`FullCacheChannel` is that channel; the full-cache level opens it
(:meth:`~specstack.model.CachedModel.open_channel`) and logs its queries into a :class:`QueryLog`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs
import torch

if TYPE_CHECKING:
    from .model import CachedModel, KVCache


@attrs.define(eq=False)
class QueryLog:
    """The query [Hq, D] of the last committed token fed to a level, per layer."""

    queries: torch.Tensor | None = None  # [L, Hq, D]

    def record(self, layer: int, layers: int, query: torch.Tensor) -> None:
        if self.queries is None or self.queries.shape[1:] != query.shape:
            self.queries = torch.zeros(layers, *query.shape, dtype=query.dtype, device=query.device)  # [L, Hq, D]
        self.queries[layer] = query


@attrs.define(eq=False)
class FullCacheChannel:
    """What a gathering level reads of the full-cache level of the same model above it."""

    _source: "CachedModel"
    queries: QueryLog

    def horizon(self, context: Sequence[int]) -> int:
        """How many leading ``context`` tokens the full cache holds, after letting it catch up when it
        lags by more than one token (e.g. at the prompt)."""
        horizon = self._source.fed_prefix(context)
        if horizon < len(context) - 1 or horizon == 0:
            self._source.logits(context, 1)
            horizon = self._source.fed_prefix(context)
        return horizon

    def keys(self, horizon: int) -> torch.Tensor:
        """[L, H, horizon, D] the committed keys."""
        return self._source.cache.keys_before(horizon)

    def copy_into(self, store: "KVCache", slots: torch.Tensor, horizon: int) -> None:
        """Fill ``store`` with the full cache's entries at ``slots`` ([K] or [L, H, K])."""
        store.gather_from(self._source.cache, slots, horizon)
