"""Host buffers on 2 MB pages: Linux's transparent huge pages, asked for one buffer at a time with ``madvise``.

A long cache is streamed whole by every forward, and on 4 KB pages it spans more pages than the CPU's TLB
maps: the default target's cache of 32,000 tokens is 740 MB in bf16, 180,000 such pages, where an AMD Zen 4
core's second-level TLB holds 3,072 (12 MB). On the Zen 4 host, with the store's keys and values on 2 MB
pages, the bf16 target's forward over 32,000 cached tokens took 1.19x less time at one token and 1.32x less
at two; over 7,500 (5.8 MB a layer, within the TLB's reach) 1.02-1.04x; eight tokens, whose attention is
arithmetic rather than memory, 1.0-1.02x. The weights on such pages measured within noise (docs/benchmarks.md,
"The one-token path without software prefetch, six rows in registers, the cache on 2 MB pages, ...").

Where the kernel has no transparent huge pages, or for another device, the buffer is an ordinary one.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes of an x86-64 (and arm64 4K-granule) transparent huge page


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape)``; a CPU buffer of at least one 2 MB page lies on such pages where the kernel grants
    them. It is a fresh anonymous mapping of its own (an allocator could hand back heap memory already touched,
    or mark a stretch of its heap that later buffers reuse), asked for huge pages before they are first touched,
    so they fault in whole as it is zeroed."""
    size = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, which has its own THP setting; the tensor keeps the mapping alive
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # [size + 2 MB]
    offset = -raw.data_ptr() % HUGE_PAGE  # the first 2 MB boundary inside it
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, size)
    except OSError:  # refused (no THP here): ordinary pages, same contents
        pass
    return raw[offset : offset + size].view(dtype).view(shape).zero_()
