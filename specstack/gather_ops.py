"""A retrieval view's copy out of the full cache, one compiled call (``csrc/gather_ops.cpp``); the same call moves a
store's per-head survivors of an eviction (H2O's) to its front in place.

Gathering a view copies each layer's and KV head's chosen entries (their keys and values) from the full cache
into the leading slots of the view's buffers. torch's way, one row gather over the cache seen as
[L * H * C, D], writes a fresh temporary that is then copied into the view's leading rows, which are strided
(the view has room after them): at 32,000 tokens, a 2,048-slot bf16 view (47 MB of keys and values) took
10-12 ms that way, where :class:`CompiledGather` copies each chunk's run of rows into place once
(docs/benchmarks.md, "A re-gather's copy in place and its selection by partition"). The bits are the same.

Where the library cannot be built, or for tensors it does not take (another device, non-contiguous buffers),
:data:`TORCH_GATHER` copies with torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import attrs
import torch

from .native import SOURCES, CompiledLibrary, load

SOURCE = SOURCES / "gather_ops.cpp"


@attrs.frozen
class TorchGather:
    """The copy with torch's row gather (the fallback, and the reference of the tests)."""

    def rows(self, sources: tuple[torch.Tensor, torch.Tensor], dests: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
        """For keys and values alike: ``dest[l, h, :K] = source[l, h, slots[l, h]]``; sources [L, H, C, D],
        dests [L, H, C', D] (C' >= K), slots [L, H, K] on their device, each below C. The dests may be the sources
        where each row of slots ascends (a store keeping some of its own entries)."""
        check_slots(slots, sources[0].shape[2])
        layers, heads, count = slots.shape
        first = torch.arange(layers * heads, device=slots.device).view(layers, heads, 1) * sources[0].shape[2]  # [L, H, 1]
        rows = (slots + first).flatten()  # [L * H * K]: the rows of the sources seen as [L * H * C, D]
        for source, dest in zip(sources, dests):
            dim = source.shape[-1]
            dest[:, :, :count] = source.view(-1, dim).index_select(0, rows).view(layers, heads, count, dim)  # [L, H, K, D]


TORCH_GATHER = TorchGather()


@attrs.frozen(kw_only=True)
class CompiledGather(CompiledLibrary):
    """The compiled copy, for contiguous CPU buffers of one dtype; others go to :data:`TORCH_GATHER`."""

    @classmethod
    def load_again(cls) -> "CompiledGather | None":
        return load_gather_ops()

    def rows(self, sources: tuple[torch.Tensor, torch.Tensor], dests: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
        """:meth:`TorchGather.rows`, copied in place."""
        if not _ours(sources, dests, slots):
            return TORCH_GATHER.rows(sources, dests, slots)
        layers, heads, count = slots.shape
        capacity = sources[0].shape[2]
        check_slots(slots, capacity)
        slots = slots.contiguous()  # [L, H, K]
        status = self.library.specstack_gather_rows(
            sources[0].data_ptr(), sources[1].data_ptr(), dests[0].data_ptr(), dests[1].data_ptr(), slots.data_ptr(),
            layers * heads, count, capacity, dests[0].shape[2], sources[0].shape[-1] * sources[0].element_size(), torch.get_num_threads())
        if status != 0:
            raise ValueError(f"gather kernel refused {count} slots into a store of capacity {dests[0].shape[2]}")


def check_slots(slots: torch.Tensor, capacity: int) -> None:
    """Raise IndexError where a slot lies outside a store of ``capacity`` slots: seen as rows of all heads' buffers, an
    out-of-range slot of one head would otherwise name another head's entry, or memory outside the buffers."""
    if slots.numel():
        low, high = (int(x) for x in torch.aminmax(slots))
        if low < 0 or high >= capacity:
            raise IndexError(f"gather slots span [{low}, {high}]; a store of capacity {capacity} holds [0, {capacity})")


def _ours(sources: tuple[torch.Tensor, ...], dests: tuple[torch.Tensor, ...], slots: torch.Tensor) -> bool:
    """Whether the compiled copy takes these: CPU tensors, contiguous buffers of one dtype and head width, int64 slots."""
    first = sources[0]
    buffers = (*sources, *dests)
    return (slots.dtype == torch.long and slots.device.type == "cpu" and slots.dim() == 3
            and all(b.device.type == "cpu" and b.is_contiguous() and b.dtype == first.dtype and b.dim() == 4 for b in buffers)
            and all(b.shape[:2] == slots.shape[:2] and b.shape[3] == first.shape[3] for b in buffers)
            and sources[1].shape[2] == first.shape[2] and dests[1].shape[2] == dests[0].shape[2] >= slots.shape[2])


GatherOps = CompiledGather | TorchGather  # what a store copies chosen entries with


def load_gather_ops(cache: Path | None = None) -> GatherOps:
    """The compiled copy, built into ``cache`` (default: the specstack cache) on first use; :data:`TORCH_GATHER`
    where it cannot be built here."""
    pointer, wide = ctypes.c_void_p, ctypes.c_int64
    loaded = load(SOURCE, "specstack_gather_rows", [pointer] * 5 + [wide] * 5 + [ctypes.c_int], cache)
    if loaded is None:
        return TORCH_GATHER
    library, path = loaded
    return CompiledGather(library=library, path=path)
