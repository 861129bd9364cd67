"""Which way this CPU's bf16 products go: AVX-512's bf16 dot products, or float32 FMAs on numbers widened from bf16.

Where the CPU has AVX-512's bf16 dot products (``vdpbf16ps``), the kernels with bf16 paths
(``csrc/decode_attention.cpp``, ``csrc/linear_rows.cpp``) are built with both ways, and which one a bf16 cache or
weight takes is decided here, from how many multiply-adds one core does a second each way (``csrc/product_rates.cpp``:
a ``vdpbf16ps`` does 32, an FMA 16). The two CPUs measured differ by 4x in that ratio:

* AMD Zen 4 (2 cores, no AMX): oneDNN's bf16 GEMM ran at 221 GFLOP/s on one core against 101 in fp32, and the dot
  products took bf16 attention 1.5-1.7x faster than widening at 3-16 tokens (docs/benchmarks.md, "bf16 verifies in
  dot products");
* Intel model 207 with the bf16 instructions (2 cores, no AMX): ``vdpbf16ps`` at 84-86 GFLOP/s a core, FMAs at
  174-175 (``csrc/product_rates.cpp``); there the widened paths took attention over 7,500 keys 1.15-1.63x less time at 3-16 tokens
  and the target's 211 layer products 1.03-1.71x less at 1-16 rows (docs/benchmarks.md, "bf16 products widened
  where the dot products are slower").

A ratio is measured once per machine and kept beside the built timing library in the kernel cache, so that every
process on the machine (a bench's workers included) takes the same paths and so computes the same bits. Beside AMX
tiles the attention kernel keeps its few-row dot products, which its tile paths were measured beside
(:func:`dot_products_pay`); the linear kernel's few rows go by the rates there too (on the AMX host of 2026-11-30,
``vdpbf16ps`` 113 GFLOP/s a core against FMAs' 228, widened products of 2-4 rows took whole bf16 forwards 1.05-1.10x
less time).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import tempfile
from pathlib import Path

import attrs

from .native import SOURCES, build, load

SOURCE = SOURCES / "product_rates.cpp"
ITERATIONS, REPEATS = 100_000, 5  # 1.2 M instructions a loop: about a millisecond each


@attrs.frozen(kw_only=True)
class ProductRates:
    """Multiply-adds a second of one core (flop/s, two per multiply-add): bf16 dot products and float32 FMAs."""

    dot_flops: float = attrs.field(validator=attrs.validators.gt(0))
    fma_flops: float = attrs.field(validator=attrs.validators.gt(0))

    @property
    def dot_products_pay(self) -> bool:
        """Whether the dot products do more multiply-adds a second than FMAs on widened numbers."""
        return self.dot_flops > self.fma_flops

    def describe(self) -> str:
        """One line: the two rates and the way bf16 products go."""
        way = "bf16 dot products" if self.dot_products_pay else "widened to float32"
        return f"bf16 products: {way} (a core: vdpbf16ps {self.dot_flops / 1e9:.0f} GFLOP/s, FMAs {self.fma_flops / 1e9:.0f}; beside AMX tiles: dot products)"


def measure_rates(cache: Path | None = None) -> ProductRates | None:
    """The rates measured now; None where the CPU (or the build) has no bf16 dot products."""
    argtypes = [ctypes.c_long, ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]
    loaded = load(SOURCE, "specstack_product_rates", argtypes, cache)
    if loaded is None:
        return None
    dot, fma = ctypes.c_double(), ctypes.c_double()
    if loaded[0].specstack_product_rates(ITERATIONS, REPEATS, ctypes.byref(dot), ctypes.byref(fma)) != 0:
        return None
    instructions = 12 * ITERATIONS
    return ProductRates(dot_flops=64 * instructions / dot.value, fma_flops=32 * instructions / fma.value)


def product_rates(cache: Path | None = None) -> ProductRates | None:
    """This machine's rates, measured on the first call and read back from the kernel cache after (beside the timing
    library, whose name holds the CPU's flags and the source); None where the CPU has no bf16 dot products."""
    library = build(SOURCE, cache)
    if library is None:
        return None
    kept = library.with_suffix(".json")
    with _alone(library.with_suffix(".lock")):  # processes starting together (test workers) measure one at a time, the first for all
        try:
            return ProductRates(**json.loads(kept.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # not measured here yet, or unreadable: measure
        rates = measure_rates(cache)
        if rates is not None:
            _keep(kept, attrs.asdict(rates))
        return rates


def dot_products_pay(*, built: bool, tiles: bool, cache: Path | None = None) -> bool:
    """Whether a kernel ``built`` with bf16 dot products takes them for bf16: always beside AMX ``tiles`` (the attention
    kernel's one-token step, measured so on such CPUs: on 2026-11-30 1.05x faster than widened and 1.15x than the tiles over
    32,000 keys), else where this CPU does more multiply-adds a second with them than with FMAs."""
    if not built:
        return False
    if tiles:
        return True
    rates = product_rates(cache)
    return rates is None or rates.dot_products_pay


def built_with(built: str):
    """An attrs validator for a kernel's switch to the bf16 dot products: on only where its attribute ``built`` says the
    kernel was built with them."""

    def check(instance, attribute, value: bool) -> None:
        if value and not getattr(instance, built):
            raise ValueError(f"{attribute.name}=True is not allowed: this kernel was built without AVX-512's bf16 dot products")

    return check


@contextlib.contextmanager
def _alone(lock: Path):
    """Hold an exclusive lock on the file ``lock`` (made if missing) while the block runs; where it cannot be made, run
    the block anyway."""
    try:
        handle = open(lock, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _keep(path: Path, numbers: dict) -> None:
    """Write ``numbers`` to ``path`` whole (a concurrent reader sees the old file or the new one); a cache that cannot
    be written keeps nothing, and the next process measures again."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump(numbers, handle)
        os.replace(handle.name, path)
    except OSError:
        pass
