"""A CPU kernel for attention of a few new tokens over a long float32 KV cache.

SDPA's CPU kernels spend 3-4x the time it takes to read the cache once when one to four tokens
attend over thousands of keys (docs/benchmarks.md). ``csrc/decode_attention.cpp`` does what
flash-decoding does (Dao et al., 2023): each thread streams its own range of the cache through an
online softmax, and the ranges are merged by their maxima. It is plain C++ with no torch headers,
compiled once per machine with the system's C++ compiler (about a second) into the specstack cache and
loaded with ctypes. Where no compiler is found, or the build fails, :func:`load_decode_kernel` returns
None and attention stays with SDPA.

Which forwards take the kernel is decided in one place, :meth:`DecodeKernel.applies`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs
import torch

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# The most new tokens that take the kernel: up to here it beat SDPA on both CPUs it was measured on
# (docs/benchmarks.md, "The decode-attention kernel"); wider verifies and prefill chunks stay with SDPA.
MAX_TOKENS = 16


@attrs.frozen(kw_only=True)
class DecodeKernel:
    """The compiled kernel: query rows of each KV head against a float32 cache on the CPU."""

    library: ctypes.CDLL = attrs.field(repr=False)
    path: Path
    max_rows: int
    max_dim: int

    def __reduce__(self):
        """Pickled (a model sent to a bench worker) as a request to load it again where it lands."""
        return load_decode_kernel, ()

    def applies(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether ``query`` [1, Hq, T, D] over ``key`` [1, Hkv, n, D] (the last T keys its own) takes the kernel."""
        _, hq, t, d = query.shape
        hkv, n = key.shape[1], key.shape[2]
        return (query.device.type == "cpu" and query.dtype == key.dtype == torch.float32 and t <= MAX_TOKENS and n > t
                and hq // hkv * t <= self.max_rows and d <= self.max_dim and d % 8 == 0 and key.stride(-1) == 1 and key.stride(-2) == d)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, sees: torch.Tensor | None) -> torch.Tensor:
        """query [1, Hq, T, D], key/value [1, Hkv, n, D] (the last T the new tokens'), ``sees`` [T, T] among
        the new tokens (None: causal, a chain) -> [1, T, Hq, D]."""
        _, hq, t, d = query.shape
        hkv, n = key.shape[1], key.shape[2]
        if value.stride(-1) != 1 or value.stride(-2) != d:
            value = value.contiguous()
        q = query.reshape(hkv, hq // hkv * t, d).contiguous()  # [Hkv, G*T, D]; row g*T + t: head g of the group, token t
        out = torch.empty_like(q)  # [Hkv, G*T, D]
        mask = None if sees is None else sees.to(device="cpu", dtype=torch.uint8).contiguous()  # [T, T]
        scale = scaling if scaling is not None else d**-0.5
        status = self.library.specstack_decode_attention_f32(
            q.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(1), value.stride(1), hkv, q.shape[1], t, d, n,
            None if mask is None else mask.data_ptr(), scale, out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise ValueError(f"decode kernel refused query {tuple(query.shape)} over keys {tuple(key.shape)}")
        return out.reshape(1, hq, t, d).transpose(1, 2)  # [1, T, Hq, D]


def load_decode_kernel(cache: Path | None = None) -> DecodeKernel | None:
    """The kernel, compiled into ``cache`` (default: the specstack cache) on first use; None where it
    cannot be built here."""
    library_path = _build(cache)
    if library_path is None:
        return None
    library = ctypes.CDLL(str(library_path))
    entry = library.specstack_decode_attention_f32
    entry.restype = ctypes.c_int
    entry.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return DecodeKernel(library=library, path=library_path, max_rows=library.specstack_max_rows(), max_dim=library.specstack_max_dim())


def _build(cache: Path | None) -> Path | None:
    """Compile the source once per source, flags, compiler and CPU; the library's path, or None."""
    compiler = find_compiler()
    if compiler is None:
        return None
    if cache is None:
        from .models import cache_dir

        cache = cache_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, compiler, platform.machine(), _cpu_flags())).encode()).hexdigest()[:16]
    target = Path(cache) / "kernels" / f"decode_attention-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                return None
            os.replace(built, target)  # atomic: concurrent builders (test workers) each install a whole file
    except OSError:  # a cache that cannot be written, a compiler that cannot be run
        return None
    return target


def find_compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``$CXX``, else ``c++``, else ``g++``; None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them), '' where the system does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""
