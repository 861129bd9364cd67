"""Preallocated KV storage with O(1) rollback (a length pointer over static buffers, as in gpt-fast).

Keys and values live in ``[layers, kv_heads, capacity, head_dim]`` buffers: grouped-query attention is
stored with its KV heads only, never expanded. A forward pass writes its new tokens at slots
``length … length+T`` of every layer (``write``), then ``commit`` moves the pointer. Rolling back a
rejected draft is ``truncate``: the pointer moves back and the stale slots are overwritten later.
After a token tree was scored, ``keep_path`` moves the accepted path's entries behind the committed
ones (O(depth)) and drops the other branches (O(1)).

The store holds storage only: masks are built by :class:`~specstack.batch.TokenBatch`, queries are
logged by :class:`~specstack.channels.QueryLog`, and the transformers ``Cache`` surface is an adapter
in :mod:`specstack.hf`.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import host_memory
from .errors import SpecstackError
from .gather_ops import TORCH_GATHER, GatherOps

Rerotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (keys [L, H, n, D], delta [n]) -> keys


class KVStore:
    """The KV cache of one level.

    ``relative_positions``: rotary positions are slot indices rather than sequence positions (the
    StreamingLLM way, for drafts whose trained context is shorter than the sequence); compaction then
    re-rotates the moved keys to their new slot with ``rerotate``.

    Re-rotation never compounds. Each key is also kept as the model wrote it (``written``, rotated for
    ``written_for``, the slot it was written at), and a moved key is that key rotated once, by its
    new slot minus ``written_for`` (RoPE angles add), so its rounding error stays that of one
    rotation however often it moves. Rotating the current key instead, by each move's delta,
    accumulates one rounding to the cache dtype per move: in bf16, after 255 one-slot moves, the
    worst key's cosine to its exact rotation was 0.954 (0.99999 this way; tests/test_rerotation.py).
    The price is a second key buffer for such stores (a draft's window: small) and O(moved keys)
    work per eviction, which StreamingLLM's ``reserve`` makes rare.
    """

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", relative_positions: bool = False, rerotate: Rerotate | None = None,
                 gather_ops: GatherOps = TORCH_GATHER) -> None:
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys = host_memory.zeros(shape, dtype=dtype, device=device)  # [L, H, C, D]; on 2 MB pages where it can
        self.values = host_memory.zeros(shape, dtype=dtype, device=device)  # [L, H, C, D]
        self.slot_positions = torch.zeros(capacity, dtype=torch.long, device="cpu")  # [C]; host bookkeeping
        self.capacity = capacity
        self.length = 0
        self.relative_positions = relative_positions
        self._rerotate = rerotate if relative_positions else None
        keeps_written = self._rerotate is not None
        self.written = torch.zeros(shape if keeps_written else (0,), dtype=dtype, device=device)  # [L, H, C, D]: keys as written
        self.written_for = torch.zeros(capacity if keeps_written else 0, dtype=torch.long, device="cpu")  # [C]; host bookkeeping
        self._incoming = torch.empty(0, dtype=torch.long, device="cpu")  # positions of the tokens being written
        self.horizon = 0  # positions below this were gathered from another store (per-head slots)
        self.gather_ops = gather_ops  # copies chosen entries to the front: a view's out of another store, a per-head eviction's in place (specstack.gather_ops)
        self.gathered = 0  # how many leading slots hold gathered entries
        self.attention: torch.Tensor | None = None  # [L, H, C] attention mass received by each slot (H2O)
        self.columns: torch.Tensor | None = None  # [L, H, C / 16, words, 16] the keys by groups of 16 slots (key_columns)
        self.columns_upto = torch.zeros(layers, dtype=torch.long, device="cpu")  # [L] leading slots whose groups are current there

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated buffers (keys, values, keys as written, attention mass, keys by columns)."""
        buffers = (self.keys, self.values, self.written) + tuple(x for x in (self.attention, self.columns) if x is not None)
        return sum(buffer.numel() * buffer.element_size() for buffer in buffers)

    @property
    def positions(self) -> torch.Tensor:
        return self.slot_positions[: self.length]  # [n]

    def truncate(self, position: int) -> None:
        if position < self.horizon:  # inside a gathered prefix: the view is stale, start over
            self.length = self.gathered = self.horizon = 0
        else:
            appended = self.slot_positions[self.gathered : self.length]  # [n - g]
            self.length = self.gathered + int(torch.searchsorted(appended, position))
        self._keys_change_from(self.length)

    def key_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys laid out by groups of 16 slots, [L, H, C / 16, words, 16] 32-bit words (word w of each slot's key, a
        slot a lane: a float32 column, or a pair of bfloat16 ones), and each layer's mark [L]: how many leading slots
        its groups hold current. The attention kernel reads the groups below the mark and lays out (and keeps) the
        others as it reads them (csrc/decode_attention.cpp, "Keys sixteen at a time"); the store lowers the marks
        wherever it changes keys below them. Made on first use (as many bytes as the keys)."""
        if self.columns is None:
            layers, heads, capacity, dim = self.keys.shape
            words = dim * self.keys.element_size() // 4
            self.columns = host_memory.zeros((layers, heads, -(-capacity // 16), words, 16), dtype=torch.int32, device=self.keys.device)
            self.columns_upto.zero_()
        return self.columns, self.columns_upto

    def _keys_change_from(self, slot: int) -> None:
        """The keys from ``slot`` on change (or are dropped): their groups in ``columns`` are no longer current."""
        if self.columns is not None:
            self.columns_upto.clamp_(max=slot - slot % 16)

    def gather_from(self, source: "KVStore", slots: torch.Tensor, horizon: int) -> None:
        """Fill this store with ``source``'s entries at ``slots`` [L, H, K] (each row ascending, every
        entry below ``horizon``): a retrieval view of a full cache. Later tokens are appended after them."""
        if self._rerotate is not None:
            raise SpecstackError("a store with cache-relative positions cannot hold gathered entries")
        k = slots.shape[-1]
        slots = slots.to(self.keys.device)  # [K] or [L, H, K]
        if slots.dim() == 1:  # the same entries for every layer and head
            self.keys[:, :, :k] = source.keys[:, :, slots]
            self.values[:, :, :k] = source.values[:, :, slots]
        else:  # each (layer, head)'s own slots
            self.gather_ops.rows((source.keys, source.values), (self.keys, self.values), slots)
        if self.attention is not None:
            self.attention[:, :, :k] = 0.0
        self.slot_positions[:k] = -1  # per-head positions differ; all lie below the horizon
        self.length = self.gathered = k
        self.horizon = horizon
        self._keys_change_from(0)

    def keep(self, slots: torch.Tensor) -> None:
        """Keep ``slots``, moving them to the front: [K] for every layer and head alike, or [L, H, K]
        per layer and KV head (each row ascending). Per-head rows must end in the same columns (the
        recent tokens); the slots before those hold different positions per head, so they are marked
        like a gathered prefix and a rollback into them starts the view over."""
        per_head = slots.dim() == 3
        if per_head and self.relative_positions:
            raise SpecstackError("per-head eviction is not supported with cache-relative positions")
        row = (slots[0, 0] if per_head else slots).cpu()  # [K]; indexes the host bookkeeping
        old_positions, old_gathered = self.slot_positions[: self.length].clone(), self.gathered
        self._take(slots, row)
        gathered = int((row < old_gathered).sum())  # leading slots without one position for all heads
        if per_head:
            gathered = max(gathered, row.shape[0] - _shared_suffix(slots))
            below = old_positions[row[gathered]] if gathered < row.shape[0] else old_positions.max() + 1
            self.horizon = max(self.horizon, int(below))
        self.slot_positions[: row.shape[0]] = old_positions[row]
        self.slot_positions[:gathered] = -1
        self.gathered = gathered
        self.length = row.shape[0]

    def _take(self, slots: torch.Tensor, row: torch.Tensor) -> None:
        """Move the entries at ``slots`` ([K], or [L, H, K] per layer and head; ``row`` [K] its first
        row on the host) to slots 0..K."""
        n = slots.shape[-1]
        slots = slots.to(self.keys.device)  # [n] or [L, H, n]
        if slots.dim() == 1:
            stay = int((row == torch.arange(n, device="cpu")).cumprod(0).sum())  # leading slots that do not move (sinks)
            self._keys_change_from(stay)
            moved = slots[stay:]  # [m]
            self.values[:, :, stay:n] = self.values[:, :, moved]
            if self.attention is not None:
                self.attention[:, :, stay:n] = self.attention[:, :, moved]
            if self._rerotate is None:
                self.keys[:, :, stay:n] = self.keys[:, :, moved]
                return
            self.written[:, :, stay:n] = self.written[:, :, moved]
            self.written_for[stay:n] = self.written_for[row[stay:]]
            delta = torch.arange(stay, n, device="cpu") - self.written_for[stay:n]  # [m]; new slot minus the one each was rotated for
            self.keys[:, :, stay:n] = self._rerotate(self.written[:, :, stay:n], delta)  # [L, H, m, D]; one rotation from the key as written
            return
        self._keys_change_from(0)
        self.gather_ops.rows((self.keys, self.values), (self.keys, self.values), slots)  # in place: each row ascending
        if self.attention is not None:
            self.attention[:, :, :n] = self.attention.gather(2, slots)

    def copy_prefix(self, source: "KVStore", length: int) -> None:
        """Become a copy of ``source``'s first ``length`` slots (a store of the same model that holds
        positions 0 … length-1 in order): one O(length) copy instead of a prefill."""
        if source.gathered or source._rerotate is not None or self._rerotate is not None or length > min(source.length, self.capacity):
            raise SpecstackError(f"cannot copy {length} slots from a store holding {source.length} (gathered {source.gathered}) into one of {self.capacity}")
        self.keys[:, :, :length] = source.keys[:, :, :length]
        self.values[:, :, :length] = source.values[:, :, :length]
        self._keys_change_from(0)
        self.slot_positions[:length] = source.slot_positions[:length]
        self.length, self.gathered, self.horizon = length, 0, 0
        if self.attention is not None:
            self.attention[:, :, :length] = 0.0

    def keys_before(self, horizon: int) -> torch.Tensor:
        """[L, H, horizon, D]: the keys of the first ``horizon`` slots (what a gathering level scores)."""
        return self.keys[:, :, :horizon]

    def keep_path(self, base: int, path: list[int]) -> None:
        """After a tree of tokens was written from slot ``base`` on: keep the nodes ``path`` (indices
        into the tree, root first), moved to slots ``base, base+1, …``, and drop every other node.
        Relative rotary positions need no re-rotation: a node at depth d was rotated for slot base+d."""
        if self.length < base + (max(path) + 1 if path else 0):
            raise SpecstackError(f"tree path {path} is not in the store (tree written from slot {base}, length {self.length})")
        source = torch.tensor(path, dtype=torch.long, device=self.keys.device) + base  # [m]
        m = len(path)
        self._keys_change_from(base)
        self.keys[:, :, base : base + m] = self.keys[:, :, source]
        self.values[:, :, base : base + m] = self.values[:, :, source]
        if self._rerotate is not None:  # each node was rotated for its depth's slot, where it now lands
            self.written[:, :, base : base + m] = self.written[:, :, source]
            self.written_for[base : base + m] = self.written_for[source.cpu()]
        if self.attention is not None:
            self.attention[:, :, base : base + m] = self.attention[:, :, source]
        if m:
            first = int(self.slot_positions[base])  # the nodes at depth 0 hold the first tree position
            self.slot_positions[base : base + m] = torch.arange(first, first + m, device="cpu")
        self.length = base + m

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary positions for new tokens at sequence ``positions`` [T] (a chain, or a tail and a tree)."""
        if self.relative_positions:
            return positions - int(positions[0]) + self.length  # [T]; slot of the first new token onwards
        return positions

    # -- one forward pass -------------------------------------------------------------------------

    def begin(self, positions: torch.Tensor) -> None:
        if self.length + positions.shape[0] > self.capacity:
            raise SpecstackError(f"KV store full: {self.length} + {positions.shape[0]} tokens exceed its {self.capacity} slots")
        self._incoming = positions

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' key/value [H, T, D] of one layer; return the layer's view [H, n+T, D]."""
        end = self.length + key.shape[1]
        self.keys[layer, :, self.length : end] = key
        self.values[layer, :, self.length : end] = value
        if self._rerotate is not None:
            self.written[layer, :, self.length : end] = key
        if self.attention is not None:
            self.attention[layer, :, self.length : end] = 0.0
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def write_at(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value [H, T, D] of one layer at ``slots`` [T] (a device tensor, so that a CUDA graph
        can replay it at other slots); return the whole layer [H, C, D] (its mask hides the rest)."""
        self._keys_change_from(0)  # any slots (a graph's replay): the kernel that reads the groups is the CPU's
        self.keys[layer].index_copy_(1, slots, key)
        self.values[layer].index_copy_(1, slots, value)
        if self._rerotate is not None:
            self.written[layer].index_copy_(1, slots, key)
        return self.keys[layer], self.values[layer]

    def accumulate_attention(self, layer: int, mass: torch.Tensor) -> None:
        """Add the attention mass [H, n+T] the new tokens gave each slot of a layer (H2O's score)."""
        self._attention()[layer, :, : mass.shape[-1]] += mass

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
        if self._rerotate is not None:
            self.written_for[self.length : self.length + n] = self.rope_positions(self._incoming)
        self.length += n


def _shared_suffix(slots: torch.Tensor) -> int:
    """How many trailing columns of ``slots`` [L, H, K] are equal in every row."""
    same = (slots == slots[:1, :1]).flatten(0, 1).all(0)  # [K]
    differing = torch.nonzero(~same)
    return slots.shape[-1] if differing.numel() == 0 else slots.shape[-1] - 1 - int(differing[-1])
