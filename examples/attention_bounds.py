"""What bounds the decode-attention kernel: the cache streamed from memory, the same work from cache, one thread.

For each number of new tokens T, the kernel's ``DecodeKernel.attend`` over a cache of N keys (bf16, or ``--dtype``) shaped as the
embedded target's (its layers, KV heads, head width and query heads per KV head, read from its config), summed
over its layers, in three settings alternated in one process (best of seven):

* from memory: every layer its own cache, as a forward reads them, from a KV store (on 2 MB pages where the kernel
  grants them; ``--small-pages``: on 4 KB pages), its keys by columns kept where the kernel reads them so ("memory, no
  store": laid out at every call instead);
* in cache: one layer's cache once per layer (5.8 MB at 7,500 keys, 25 MB at 32,000: within the last-level cache
  of the host this was measured on), so memory waits mostly vanish and what is left is the kernel's own
  arithmetic and data movement;
* in cache, one thread: against two threads it says whether that work scales with the cores (it is compute).

The floor is the cache's bytes read once at the bandwidth ``specstack.floor.measure_bandwidth`` measures.
``--group`` sets the query heads per KV head, so that T tokens make other numbers of rows. ``--source`` builds
other versions of ``csrc/decode_attention.cpp`` side by side (from memory, and in cache on one thread), to compare a
change in one process; their outputs are checked against the shipped kernel's.

    python examples/attention_bounds.py --tokens 1 8 16 --keys 7500 32000
    python examples/attention_bounds.py --tokens 1 8 --keys 7500 --source /tmp/variant.cpp
    git show eb3bf99:specstack/csrc/decode_attention.cpp > /tmp/before.cpp   # docs/benchmarks.md, fp32 on AVX2
    python examples/attention_bounds.py --dtype float32 --tokens 1 2 3 4 6 8 12 16 --source /tmp/before.cpp
    mkdir -p /tmp/before && cp specstack/csrc/*.h /tmp/before/   # a version that includes the shared headers builds beside them
    git show 792743f:specstack/csrc/decode_attention.cpp > /tmp/before/decode_attention.cpp   # bf16 widened into scratch
    python examples/attention_bounds.py --tokens 1 2 4 --keys 7500 32000 --source /tmp/before/decode_attention.cpp
    git show e67c971:specstack/csrc/decode_attention.cpp > /tmp/before/decode_attention.cpp   # the GEMM path from 8 rows
    python examples/attention_bounds.py --dtype float32 --group 4 --tokens 2 3 --keys 7500 32000 --source /tmp/before/decode_attention.cpp
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from specstack.decode_attention import load_decode_kernel
from specstack.floor import ModelShape, measure_bandwidth
from specstack.kvstore import KVStore
from specstack.models import prepare_target


def built(source: Path | None = None):
    """The decode-attention kernel compiled from ``source`` (default: the shipped one)."""
    kernel = load_decode_kernel(source=source)
    if kernel is None:
        raise SystemExit(f"{source or 'the decode-attention kernel'} did not build here")
    return kernel


def best_seconds(calls: dict, repeats: int = 7) -> dict:
    """The best time of each of ``calls`` (name -> (function, threads)), alternated ``repeats`` times."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, (call, threads) in calls.items():
            torch.set_num_threads(threads)
            began = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


def random_store(layers: int, shape: tuple[int, int, int], dtype: torch.dtype, generator: torch.Generator, small_pages: bool) -> KVStore:
    """A KV store of every layer's random keys and values, shape [Hkv, n, D] a layer (on 4 KB pages where ``small_pages``)."""
    store = KVStore(layers=layers, kv_heads=shape[0], head_dim=shape[2], capacity=shape[1], dtype=dtype)
    if small_pages:
        store.keys, store.values = torch.zeros_like(store.keys), torch.zeros_like(store.values)
    for buffer in (store.keys, store.values):
        for layer in buffer:
            layer.copy_(torch.randn(shape, generator=generator))
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--keys", type=int, nargs="+", default=[7500])
    parser.add_argument("--source", type=Path, nargs="*", default=[], help="other versions of decode_attention.cpp to time beside the shipped one")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the cache's and queries' dtype")
    parser.add_argument("--group", type=int, default=None, help="query heads per KV head (default: the target's), so that T tokens make group x T rows")
    parser.add_argument("--small-pages", action="store_true", help="the cache on 4 KB pages (default: on 2 MB pages where the kernel grants them, as the KV store lays it)")
    args = parser.parse_args()
    if args.group is not None and args.group < 1:
        parser.error(f"--group {args.group} is not allowed; use 1 or more query heads per KV head")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(prepare_target()))
    layers, kv_heads, group, dim = shape.layers, shape.kv_heads, args.group or shape.heads // shape.kv_heads, shape.head_dim
    shipped = built()
    others = {str(path): built(path) for path in args.source}
    bandwidth = measure_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; kernel paths here: tiles={shipped.amx}, dot products={shipped.dot_products}")
    generator = torch.Generator().manual_seed(0)
    for n in args.keys:
        store = random_store(layers, (kv_heads, n + max(args.tokens), dim), dtype, generator, args.small_pages)  # [L, Hkv, n + T, D] keys and values
        keys, values = [layer[None] for layer in store.keys], [layer[None] for layer in store.values]  # [1, Hkv, n + T, D] each
        floor = shape.kv_elements(n) * dtype.itemsize / bandwidth  # the cache read once
        for t in args.tokens:
            query = torch.randn(1, kv_heads * group, t, dim, generator=generator).to(dtype)  # [1, Hq, T, D]
            k, v = [x[:, :, : n + t] for x in keys], [x[:, :, : n + t] for x in values]

            store.length = n  # the cached keys; the kernels keep the store's keys by columns current below it where they read them so

            def every_layer(kernel, same: bool, columns: bool = True):
                held = store if columns else None
                return lambda: [kernel.attend(query, k[0 if same else i], v[0 if same else i], None, None, held, 0 if same else i) for i in range(layers)]

            calls = {"memory": (every_layer(shipped, False), args.threads), "cache": (every_layer(shipped, True), args.threads),
                     "cache, 1 thread": (every_layer(shipped, True), 1)}
            if shipped.column_keys(dtype, dim, group * t):  # the keys laid out by columns at every call, as without a store
                calls["memory, no store"] = (every_layer(shipped, False, columns=False), args.threads)
            want = shipped.attend(query, k[0], v[0], None, None)
            for name, kernel in others.items():
                if not torch.equal(kernel.attend(query, k[0], v[0], None, None), want):
                    print(f"  {name}: outputs differ from the shipped kernel's at T={t}, N={n}")
                calls[name] = (every_layer(kernel, False), args.threads)
                calls[f"{name}, cache, 1 thread"] = (every_layer(kernel, True), 1)
            best = best_seconds(calls)
            torch.set_num_threads(args.threads)
            line = "  ".join(f"{name} {1e3 * s:.2f} ms ({s / floor:.2f}x)" for name, s in best.items())
            print(f"N={n} T={t:2d} rows={group * t:2d} tiles={shipped.tiles(dtype, dim, t, n)} floor {1e3 * floor:.2f} ms | {line}")


if __name__ == "__main__":
    main()
