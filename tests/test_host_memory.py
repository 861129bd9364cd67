"""The KV store's buffers on 2 MB pages (specstack.host_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specstack import host_memory
from specstack.kvstore import KVStore

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")


def mappings(tensor: torch.Tensor) -> list[dict[str, str]]:
    """The /proc/self/smaps entries (field -> value) of the mappings that ``tensor``'s bytes lie in."""
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    found, entry = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms offset ...
            low, high = (int(x, 16) for x in head.split("-"))
            entry = {} if low < end and high > begin else None
            if entry is not None:
                found.append(entry)
        elif entry is not None:
            entry[head.rstrip(":")] = rest.strip()
    return found


@needs_thp
def test_a_long_cache_is_asked_for_on_huge_pages() -> None:
    """A store of 32 MB a buffer asks for 2 MB pages for its keys and values: every mapping they lie in is
    marked for huge pages (VmFlags "hg", what MADV_HUGEPAGE sets; which pages the kernel then grants is its
    choice, and it granted them for the 32K cache in docs/benchmarks.md). Alone, the same buffer from torch.zeros
    is not marked; in one fresh-clone suite a worker's torch.zeros buffer was, for a reason not found, so that is
    not asserted here."""
    store = KVStore(layers=4, kv_heads=2, head_dim=64, capacity=32_768, dtype=torch.bfloat16)
    for buffer in (store.keys, store.values):
        assert all("hg" in entry["VmFlags"].split() for entry in mappings(buffer)), mappings(buffer)


def test_the_buffers_are_zeros_of_the_asked_shape_wherever_they_lie() -> None:
    for shape, dtype in [((2, 3, 600_000, 4), torch.bfloat16), ((3, 5), torch.float32), ((1, 1, 2**19, 1), torch.float32)]:
        buffer = host_memory.zeros(shape, dtype=dtype)  # large (a huge-page request), small, exactly one huge page
        assert buffer.shape == shape and buffer.dtype == dtype and buffer.is_contiguous()
        assert not buffer.any()
        buffer.fill_(1)  # writable over its whole extent
        assert bool((buffer == 1).all())
