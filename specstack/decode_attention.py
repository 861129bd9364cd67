"""A CPU kernel for attention of a few new tokens over a long float32 or bfloat16 KV cache.

SDPA's CPU kernels took 3-4x the time it takes to read the cache once (AMD Zen 3) and about 2x
(Intel with AVX-512) when one to four tokens attend over 7,500 keys (docs/benchmarks.md). ``csrc/decode_attention.cpp`` does what
flash-decoding does (Dao et al., 2023): each thread streams its own range of the cache through an
online softmax, and the ranges are merged by their maxima. A verify's many query rows are scored six at a time
against each key (AVX2), or, with AVX-512, from keys laid out sixteen at a time by columns, which a KV store keeps
(:meth:`KVStore.key_columns`), so each is laid out once. A bfloat16 cache is
read as it is stored and widened to float32 block by block: queries, arithmetic and output are
float32, rounded once to bfloat16 at the end. Where the CPU has AMX tiles (and Linux lends them), a
bfloat16 cache takes them instead: bf16 tile products for the scores and for the weighted values, the
softmax in float32, the weights rounded to bf16 (as SDPA's bf16 kernels round them). Where the CPU has
AVX-512's bf16 dot products, a few query rows per KV head take them in registers instead, with the same
rounding: three or fewer beside AMX tiles (a one-token step with GQA groups of three, 1.13x faster than
the tiles over 7,500 and 32,000 keys), fifteen or fewer without them (a verify of up to five tokens, in groups of
six rows or fewer); without AMX, more rows take the same dot products, block by block (1.5-1.7x faster than
widening at 3-16 tokens over 32,000 keys on the AMD Zen 4 host). The dot products take their keys transposed sixteen
at a time, as the column path does, and so read (and keep) the same copy in the store at any number of rows: whole
forwards on the Zen 4 host took 0.99-1.13x the previous kernel's speed at 1-16 tokens over 7,500 keys (1.02-1.13x in
the longer of two runs) and 1.01-1.09x over 32,000, the same bits. Without AMX they are taken only where they pay
(:mod:`specstack.bf16_products`): on an Intel host with them, whose FMAs do twice their multiply-adds a second,
the widening paths took attention over 7,500 keys 1.15-1.63x less time at 3-16 tokens. The widening paths cut the
keys into spans fixed from key 0 and fold the new tokens' own keys into them under the mask (a token tree's node over
its own path, gathered as its step holds it), so every token of a chain or tree verify gets exactly the one-token
step's sums at its position (docs/exactness.md). It is built and loaded by
:mod:`specstack.native`; where it cannot be built, :func:`load_decode_kernel` returns None and
attention stays with SDPA.

Which forwards take the kernel is decided in one place, :meth:`DecodeKernel.applies`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from .bf16_products import built_with, dot_products_pay
from .native import SOURCES, CompiledLibrary, load

if TYPE_CHECKING:
    from .kvstore import KVStore

SOURCE = SOURCES / "decode_attention.cpp"
# The most new tokens that take the kernel, per cache dtype: up to here it beat SDPA on the CPUs it was
# measured on (docs/benchmarks.md, "The decode-attention kernel"). A bfloat16 cache widened to float32
# loses to SDPA's own bf16 kernel from six tokens; on AMX tiles it beat SDPA 1.9-2.2x from 1 to 16
# tokens ("bf16 attention on AMX tiles"), and whole forwards of 20-64 tokens took 1.6-2.7x less time than with SDPA ("Verifies of up to
# 64 tokens on the tiles"). Wider verifies and prefill chunks stay with SDPA.
MAX_TOKENS = {torch.float32: 16, torch.bfloat16: 4}
MAX_TOKENS_AMX = 64  # a bfloat16 cache where the kernel runs on AMX tiles (192 rows: csrc/decode_attention.cpp, MAX_ROWS)
# A bfloat16 cache on a CPU without AVX-512's bf16 dot products (AVX2), where SDPA's bf16 kernel has no bf16
# instructions either: the widening kernel took 1.40-1.80x less time than the split SDPA path for 5-16 tokens
# over 7,500 and 32,000 keys on the 2-core AMD host (docs/benchmarks.md, "bf16 on AVX2"; examples/bf16_widened.py
# --attention).
MAX_TOKENS_WIDENED_BF16 = 16
# A bfloat16 cache with heads of 64 or 128 on a CPU with AVX-512's bf16 dot products (and no AMX tiles): a verify's
# rows take the dot products too, 1.5-1.7x faster than widening at 3-16 tokens over 32,000 keys on the AMD Zen 4
# host (docs/benchmarks.md, "bf16 verifies in dot products"), where SDPA took 2.5-3.9x the kernel's time.
MAX_TOKENS_DOT_PRODUCTS = 16
# Up to MAX_TOKENS[bfloat16] new tokens over fewer cached keys than this, widening stays faster than the
# tiles' fixed costs: whole target forwards 0.93-0.96x with tiles over 512-1,024 keys, 1.01x over 2,048.
AMX_MIN_KEYS = 2048


@attrs.frozen(kw_only=True)
class DecodeKernel(CompiledLibrary):
    """The compiled kernel: query rows of each KV head against a float32 or bfloat16 cache on the CPU."""

    max_rows: int
    max_dim: int
    amx: bool = False  # a bfloat16 cache takes AMX tiles (the CPU has them and Linux lends them)
    dot_products_built: bool = False  # built with AVX-512's bf16 dot-product paths (the CPU has them)
    # a bfloat16 cache (heads of 64 or 128) takes them: up to three query rows always, more without tiles; else it is widened.
    # Chosen at load where they pay (specstack.bf16_products); attrs.evolve turns either way on where both are built.
    dot_products: bool = attrs.field(default=False, validator=built_with("dot_products_built"))

    @classmethod
    def load_again(cls) -> "DecodeKernel | None":
        return load_decode_kernel()

    def applies(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``query`` [1, Hq, T, D] over ``key``/``value`` [1, Hkv, n, D] (the last T its own) takes
        the kernel: float32 or bfloat16 on the CPU, a few tokens (``MAX_TOKENS``) over cached ones, keys and values
        stored in rows (as the KV store holds them, each head a strided view)."""
        _, hq, t, d = query.shape
        hkv, n = key.shape[1], key.shape[2]
        in_rows = all(x.stride(-1) == 1 and x.stride(-2) == d for x in (key, value))
        return query.device.type == "cpu" and query.dtype == key.dtype == value.dtype and in_rows and self.takes(key.dtype, hq, hkv, t, d, n)

    def takes(self, dtype: torch.dtype, hq: int, hkv: int, t: int, d: int, n: int) -> bool:
        """Whether ``t`` new tokens of ``hq`` query heads over ``n`` keys (the last t their own) of ``hkv`` heads
        of width ``d``, a CPU cache of ``dtype`` stored in rows, are the kernel's."""
        return t <= self.max_tokens(dtype, d) and n > t and hq // hkv * t <= self.max_rows and d <= self.max_dim and d % 8 == 0

    def max_tokens(self, dtype: torch.dtype, d: int) -> int:
        """The most new tokens a cache of ``dtype`` with heads of width ``d`` hands the kernel."""
        if self._tiles_fit(dtype, d):
            return MAX_TOKENS_AMX
        if dtype == torch.bfloat16 and self.dot_products and d in (64, 128):
            return MAX_TOKENS_DOT_PRODUCTS
        if dtype == torch.bfloat16 and not self.dot_products:
            return MAX_TOKENS_WIDENED_BF16
        return MAX_TOKENS.get(dtype, 0)

    def tiles(self, dtype: torch.dtype, d: int, t: int, n: int) -> bool:
        """Whether ``t`` new tokens over ``n`` keys of such a cache run on AMX tiles rather than widened."""
        return self._tiles_fit(dtype, d) and (t > MAX_TOKENS[torch.bfloat16] or n >= AMX_MIN_KEYS)

    def _tiles_fit(self, dtype: torch.dtype, d: int) -> bool:
        """AMX tiles here, a bfloat16 cache, heads a multiple of 32 wide."""
        return self.amx and dtype == torch.bfloat16 and d % 32 == 0

    def column_keys(self, dtype: torch.dtype, d: int, rows: int) -> bool:
        """Whether ``rows`` query rows a KV head over a cache of ``dtype`` with heads of width ``d`` read its keys by
        groups laid out by columns, so that a KV store's copy of them (:meth:`KVStore.key_columns`) saves laying them
        out at every forward."""
        entry = getattr(self.library, "specstack_column_keys", None)  # a kernel built from an older source has none
        return entry is not None and entry(int(dtype == torch.bfloat16), d, rows, int(self.dot_products)) == 1

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, sees: torch.Tensor | None,
               store: "KVStore | None" = None, layer: int = 0) -> torch.Tensor:
        """query [1, Hq, T, D], key/value [1, Hkv, n, D] (the last T the new tokens'), ``sees`` [T, T] among
        the new tokens (None: causal, a chain) -> [1, T, Hq, D] in the query's dtype. Where ``key`` is layer
        ``layer`` of ``store``, the store's copy of its keys by columns is read and kept up to date."""
        return self.attend_float32(query, key, value, scaling, sees, store, layer).to(query.dtype)

    def attend_float32(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, sees: torch.Tensor | None,
                       store: "KVStore | None" = None, layer: int = 0) -> torch.Tensor:
        """:meth:`attend`'s output as the kernel computes it, float32 [1, T, Hq, D], before any rounding to the query's dtype."""
        _, hq, t, d = query.shape
        hkv, n = key.shape[1], key.shape[2]
        q = query.reshape(hkv, hq // hkv * t, d).float().contiguous()  # [Hkv, G*T, D]; row g*T + t: head g of the group, token t
        out = torch.empty_like(q)  # [Hkv, G*T, D], float32
        mask = None if sees is None else sees.to(device="cpu", dtype=torch.bool).contiguous().view(torch.uint8)  # [T, T], 0 or 1, no copy
        scale = scaling if scaling is not None else d**-0.5
        args = (q.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(1), value.stride(1), hkv, q.shape[1], t, d, n,
                None if mask is None else mask.data_ptr(), scale, out.data_ptr(), torch.get_num_threads(), key.dtype == torch.bfloat16,
                self.tiles(key.dtype, d, t, n), self.dot_products)
        if store is not None and key.data_ptr() == store.keys[layer].data_ptr() and self.column_keys(key.dtype, d, q.shape[1]):
            columns, marks = store.key_columns()  # [L, Hkv, C / 16, words, 16], [L]
            status = self.library.specstack_decode_attention_columns(*args, columns[layer].data_ptr(), columns.stride(1), marks[layer:].data_ptr())
        else:
            status = self.library.specstack_decode_attention(*args)
        if status != 0:
            raise ValueError(f"decode kernel refused query {tuple(query.shape)} over keys {tuple(key.shape)}")
        return out.reshape(1, hq, t, d).transpose(1, 2)  # [1, T, Hq, D]


# specstack_decode_attention's arguments (csrc/decode_attention.cpp)
ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int] * 4


def load_decode_kernel(cache: Path | None = None, *, source: Path | None = None) -> DecodeKernel | None:
    """The kernel, compiled into ``cache`` (default: the specstack cache) on first use; None where it
    cannot be built here. ``source`` (default: :data:`SOURCE`, read at the call) is another version of
    ``csrc/decode_attention.cpp`` a benchmark builds beside it (examples/attention_bounds.py)."""
    loaded = load(SOURCE if source is None else source, "specstack_decode_attention", ARGTYPES, cache)
    if loaded is None:
        return None
    library, path = loaded
    if hasattr(library, "specstack_decode_attention_columns"):  # a kernel built from an older source has only the entry above
        columns = library.specstack_decode_attention_columns
        columns.restype, columns.argtypes = ctypes.c_int, ARGTYPES + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    amx, built = library.specstack_amx_bf16() == 1, library.specstack_dp_bf16() == 1
    return DecodeKernel(library=library, path=path, max_rows=library.specstack_max_rows(), max_dim=library.specstack_max_dim(),
                        amx=amx, dot_products_built=built, dot_products=dot_products_pay(built=built, tiles=amx, cache=cache))
