"""Preallocated KV storage with O(1) rollback (a length pointer over static buffers, as in gpt-fast).

Keys and values live in ``[layers, kv_heads, capacity, head_dim]`` buffers: grouped-query attention is
stored with its KV heads only, never expanded. A forward pass writes its new tokens at slots
``length … length+T`` of every layer (``update``), then ``commit`` moves the pointer. Rolling back a
rejected draft is ``truncate``: the pointer moves back and the stale slots are overwritten later.
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention import Select
from .errors import SpecstackError

Rerotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (keys [L, H, n, D], delta [n]) -> keys


def causal_mask(t: int, n: int, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[group*T, n] boolean mask for T new tokens at the end of n keys, rows repeated per query head."""
    causal = torch.ones(t, n, dtype=torch.bool, device=device).tril(diagonal=n - t)  # [T, n]
    return causal.repeat(group, 1)  # [G*T, n]


class KVStore:
    """The KV cache of one level (also the transformers ``Cache`` the model writes into).

    ``relative_positions``: rotary positions are slot indices rather than sequence positions (the
    StreamingLLM way, for drafts whose trained context is shorter than the sequence); compaction then
    re-rotates the moved keys by their change of slot with ``rerotate``.
    """

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", relative_positions: bool = False, rerotate: Rerotate | None = None) -> None:
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, H, C, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, H, C, D]
        self.slot_positions = torch.zeros(capacity, dtype=torch.long)  # [C]
        self.capacity = capacity
        self.length = 0
        self.relative_positions = relative_positions
        self._rerotate = rerotate
        self._incoming = torch.empty(0, dtype=torch.long)  # positions of the tokens being written
        self._mask: torch.Tensor | None = None  # the current forward's causal mask, built once for all layers
        self.horizon = 0  # positions below this were gathered from another store (per-head slots)
        self.gathered = 0  # how many leading slots hold gathered entries
        self.records_queries = False  # set by a level that scores this store's keys (retrieval)
        self.last_queries: torch.Tensor | None = None  # [L, Hq, D] query of the last token fed, per layer
        self.records_attention = False  # set by a level whose policy reads accumulated attention (H2O)
        self.attention: torch.Tensor | None = None  # [L, H, C] attention mass received by each slot
        self.attention_filter: Select | None = None  # set by a level whose policy restricts each query (Top-K)

    def __len__(self) -> int:
        return self.length

    @property
    def positions(self) -> torch.Tensor:
        return self.slot_positions[: self.length]  # [n]

    def truncate(self, position: int) -> None:
        if position < self.horizon:  # inside a gathered prefix: the view is stale, start over
            self.length = self.gathered = self.horizon = 0
            return
        appended = self.slot_positions[self.gathered : self.length]  # [n - g]
        self.length = self.gathered + int(torch.searchsorted(appended, position))

    def gather_from(self, source: "KVStore", slots: torch.Tensor, horizon: int) -> None:
        """Fill this store with ``source``'s entries at ``slots`` [L, H, K] (each row ascending, every
        entry below ``horizon``): a retrieval view of a full cache. Later tokens are appended after them."""
        k = slots.shape[-1]
        if slots.dim() == 1:  # the same entries for every layer and head
            self.keys[:, :, :k] = source.keys[:, :, slots]
            self.values[:, :, :k] = source.values[:, :, slots]
        else:
            index = slots[..., None].expand(-1, -1, -1, self.keys.shape[-1]).to(self.keys.device)  # [L, H, K, D]
            self.keys[:, :, :k] = source.keys[:, :, :horizon].gather(2, index)
            self.values[:, :, :k] = source.values[:, :, :horizon].gather(2, index)
        if self.attention is not None:
            self.attention[:, :, :k] = 0.0
        self.slot_positions[:k] = -1  # per-head positions differ; all lie below the horizon
        self.length = self.gathered = k
        self.horizon = horizon

    def keep(self, slots: torch.Tensor) -> None:
        """Keep ``slots``, moving them to the front: [K] for every layer and head alike, or [L, H, K]
        per layer and KV head (each row ascending). Per-head rows must end in the same columns (the
        recent tokens); the slots before those hold different positions per head, so they are marked
        like a gathered prefix and a rollback into them starts the view over."""
        per_head = slots.dim() == 3
        if per_head and self.relative_positions:
            raise SpecstackError("per-head eviction is not supported with cache-relative positions")
        row = slots[0, 0] if per_head else slots  # [K]
        old_positions, old_gathered = self.slot_positions[: self.length].clone(), self.gathered
        self._take(slots)
        gathered = int((row < old_gathered).sum())  # leading slots without one position for all heads
        if per_head:
            gathered = max(gathered, row.shape[0] - _shared_suffix(slots))
            below = old_positions[row[gathered]] if gathered < row.shape[0] else old_positions.max() + 1
            self.horizon = max(self.horizon, int(below))
        self.slot_positions[: row.shape[0]] = old_positions[row]
        self.slot_positions[:gathered] = -1
        self.gathered = gathered
        self.length = row.shape[0]

    def _take(self, slots: torch.Tensor) -> None:
        """Move the entries at ``slots`` ([K], or [L, H, K] per layer and head) to slots 0..K."""
        n = slots.shape[-1]
        if slots.dim() == 1:
            moved = self.keys[:, :, slots]  # [L, H, n, D]
            if self.relative_positions and self._rerotate is not None:
                moved = self._rerotate(moved, torch.arange(n) - slots)  # every kept slot moves down
            self.keys[:, :, :n] = moved
            self.values[:, :, :n] = self.values[:, :, slots]
            if self.attention is not None:
                self.attention[:, :, :n] = self.attention[:, :, slots]
            return
        index = slots[..., None].expand(-1, -1, -1, self.keys.shape[-1]).to(self.keys.device)  # [L, H, n, D]
        self.keys[:, :, :n] = self.keys.gather(2, index)
        self.values[:, :, :n] = self.values.gather(2, index)
        if self.attention is not None:
            self.attention[:, :, :n] = self.attention.gather(2, slots.to(self.attention.device))

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions for new tokens at sequence ``positions`` [T]."""
        if self.relative_positions:
            return torch.arange(self.length, self.length + positions.shape[0])  # [T]
        return positions

    # -- the transformers Cache surface used during a forward pass ---------------------------

    def begin(self, positions: torch.Tensor) -> None:
        if self.length + positions.shape[0] > self.capacity:
            raise SpecstackError(f"KV store full: {self.length} + {positions.shape[0]} tokens exceed its {self.capacity} slots")
        self._incoming = positions
        self._mask = None

    def causal_mask(self, group: int) -> torch.Tensor:
        """[group*T, n+T] mask of the current forward: every cached slot, then new tokens up to each
        query's own; rows repeat per query head of a GQA group. Built once, shared by every layer."""
        if self._mask is None:
            t = self._incoming.shape[0]
            self._mask = causal_mask(t, self.length + t, group, self.keys.device)
        return self._mask

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' key/value [1, H, T, D] of one layer; return the layer's view [1, H, n+T, D]."""
        end = self.length + key.shape[2]
        self.keys[layer_idx, :, self.length : end] = key[0]
        self.values[layer_idx, :, self.length : end] = value[0]
        if self.records_attention:
            self._attention()[layer_idx, :, self.length : end] = 0.0
        return self.keys[layer_idx, :, :end][None], self.values[layer_idx, :, :end][None]

    def record_query(self, layer_idx: int, query: torch.Tensor) -> None:
        """Remember the last token's query [Hq, D] of a layer (retrieval scores chunks with it)."""
        if self.last_queries is None:
            self.last_queries = torch.zeros(self.keys.shape[0], *query.shape, dtype=query.dtype)
        self.last_queries[layer_idx] = query

    def accumulate_attention(self, layer_idx: int, mass: torch.Tensor) -> None:
        """Add the attention mass [H, n+T] the new tokens gave each slot of a layer (H2O's score)."""
        self._attention()[layer_idx, :, : mass.shape[-1]] += mass

    def attention_mass(self) -> torch.Tensor:
        """[L, H, n]: the attention each occupied slot has received since it was written."""
        return self._attention()[:, :, : self.length]

    def _attention(self) -> torch.Tensor:
        if self.attention is None:
            with torch.inference_mode(False):  # a normal tensor, updatable outside inference mode too
                self.attention = torch.zeros(self.keys.shape[:3], dtype=torch.float32, device=self.keys.device)  # [L, H, C]
        return self.attention

    def commit(self) -> None:
        n = self._incoming.shape[0]
        self.slot_positions[self.length : self.length + n] = self._incoming
        self.length += n

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def _shared_suffix(slots: torch.Tensor) -> int:
    """How many trailing columns of ``slots`` [L, H, K] are equal in every row."""
    same = (slots == slots[:1, :1]).flatten(0, 1).all(0)  # [K]
    differing = torch.nonzero(~same)
    return slots.shape[-1] if differing.numel() == 0 else slots.shape[-1] - 1 - int(differing[-1])
