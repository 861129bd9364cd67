"""Compiled CPU kernels: each a C++ source in ``specstack/csrc``, built once per machine and loaded with ctypes.

The sources are plain C++ with GCC vector types and OpenMP, no torch headers: one compiler call
(about a second) builds each into the specstack cache, named by a hash of the source, the flags, the
compiler and the CPU's feature flags (``-march=native`` compiles for them), so a changed source or
another machine builds anew. :func:`build` returns None where there is no compiler, the build fails,
or the cache cannot be written; each caller then keeps its torch path.
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

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


@attrs.define(kw_only=True, eq=False)
class CompiledLibrary:
    """A library built from one source of ``csrc`` (:func:`load`) and where it lies: the base of each kernel's wrapper.
    Pickled or copied (with a model, or a KV store) a wrapper travels as a request to load its kernel again where it
    lands (the subclass's :meth:`load_again`): a loaded library cannot be copied, and another machine builds its own."""

    library: ctypes.CDLL = attrs.field(repr=False)
    path: Path

    def __reduce__(self):
        return type(self).load_again, ()

    @classmethod
    def load_again(cls) -> "CompiledLibrary | None":
        """The kernel loaded here (None where it cannot be built)."""
        raise NotImplementedError(f"{cls.__name__} does not say how it is loaded again")


def load(source: Path, entry: str, argtypes: list, cache: Path | None = None) -> tuple[ctypes.CDLL, Path] | None:
    """The library built from ``source`` (see :func:`build`) and its path, its function ``entry``
    declared as returning an int status and taking ``argtypes``; None where it cannot be built."""
    path = build(source, cache)
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    function = getattr(library, entry)
    function.restype, function.argtypes = ctypes.c_int, argtypes
    return library, path


def build(source: Path, cache: Path | None = None) -> Path | None:
    """The shared library compiled from ``source`` into ``cache`` (default: the specstack cache),
    built on first use; None where it cannot be built here."""
    compiler = find_compiler()
    if compiler is None:
        return None
    if cache is None:
        from .models import cache_dir

        cache = cache_dir()
    source = Path(source)
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))  # what the source may include
    key = hashlib.sha256(source.read_bytes() + headers + repr((FLAGS, compiler, platform.machine(), _cpu_flags())).encode()).hexdigest()[:16]
    target = Path(cache) / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                return None
            os.replace(built, target)  # atomic: concurrent builders (test workers) each install a whole file
    except OSError:  # a cache that cannot be written, a compiler that cannot be run
        return None
    return target


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with: ``$CXX``, else ``c++``, else ``g++``; None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _cpu_flags() -> str:
    """The CPU's feature flags, '' where the system does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""
