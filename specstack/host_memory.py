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

import ctypes
import math
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes of an x86-64 (and arm64 4K-granule) transparent huge page
MADV_HUGEPAGE = 14  # <linux/mman.h>


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape)``; a CPU buffer of at least one 2 MB page on Linux lies on such pages where the
    kernel grants them (the ``madvise`` comes before the pages are first touched, so they fault in whole)."""
    size = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if torch.device(device).type != "cpu" or size < HUGE_PAGE or madvise is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # untouched: the allocator maps large buffers fresh
    offset = -raw.data_ptr() % HUGE_PAGE  # the first 2 MB boundary inside it
    madvise(raw.data_ptr() + offset, size, MADV_HUGEPAGE)  # refused (no THP): ordinary pages, same contents
    return raw[offset : offset + size].view(dtype).view(shape).zero_()


def _madvise():
    """libc's ``madvise`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function
