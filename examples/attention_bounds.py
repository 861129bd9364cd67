"""What bounds the decode-attention kernel: the cache streamed from memory, the same work from cache, one thread.

For each number of new tokens T, the kernel's ``DecodeKernel.attend`` over a bf16 cache of N keys (the default
target's shape: 3 KV heads of 64, groups of 3 query heads), summed over 30 layers, in three settings alternated in
one process (best of seven):

* from memory: 30 distinct layers' caches, as a forward reads them;
* in cache: one layer's cache 30 times (a few MB, held in the last-level cache), so memory waits mostly vanish
  and what is left is the kernel's own arithmetic and data movement;
* in cache, one thread: against two threads it says whether that work scales with the cores (it is compute).

The floor is the cache's bytes read once at the bandwidth ``specstack.floor.measure_bandwidth`` measures.
``--source`` builds other versions of ``csrc/decode_attention.cpp`` side by side (from memory only), to compare a
change in one process; their outputs are checked against the shipped kernel's.

    python examples/attention_bounds.py --tokens 1 8 16 --keys 7500 32000
    python examples/attention_bounds.py --tokens 1 8 --keys 7500 --source /tmp/variant.cpp
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from specstack import decode_attention
from specstack.floor import measure_bandwidth
from specstack.native import load

LAYERS, KV_HEADS, GROUP, DIM = 30, 3, 3, 64  # the embedded target's attention


def built(source: Path) -> decode_attention.DecodeKernel:
    """``source`` (a version of decode_attention.cpp) compiled and loaded as the shipped kernel is."""
    argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int] * 4
    loaded = load(source, "specstack_decode_attention", argtypes)
    if loaded is None:
        raise SystemExit(f"{source} did not build")
    library, path = loaded
    return decode_attention.DecodeKernel(library=library, path=path, max_rows=library.specstack_max_rows(), max_dim=library.specstack_max_dim(),
                                         amx=library.specstack_amx_bf16() == 1, dot_products=library.specstack_dp_bf16() == 1)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--keys", type=int, nargs="+", default=[7500])
    parser.add_argument("--source", type=Path, nargs="*", default=[], help="other versions of decode_attention.cpp to time beside the shipped one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shipped = decode_attention.load_decode_kernel()
    if shipped is None:
        raise SystemExit("the decode-attention kernel could not be built here")
    others = {str(path): built(path) for path in args.source}
    bandwidth = measure_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; kernel paths here: tiles={shipped.amx}, dot products={shipped.dot_products}")
    generator = torch.Generator().manual_seed(0)
    for n in args.keys:
        keys = [torch.randn(1, KV_HEADS, n + max(args.tokens), DIM, generator=generator).bfloat16() for _ in range(LAYERS)]  # [1, Hkv, n + T, D] each
        values = [torch.randn(1, KV_HEADS, n + max(args.tokens), DIM, generator=generator).bfloat16() for _ in range(LAYERS)]
        floor = LAYERS * KV_HEADS * n * DIM * 2 * 2 / bandwidth
        for t in args.tokens:
            query = torch.randn(1, KV_HEADS * GROUP, t, DIM, generator=generator).bfloat16()  # [1, Hq, T, D]
            k, v = [x[:, :, : n + t] for x in keys], [x[:, :, : n + t] for x in values]

            def layers(kernel, same: bool):
                return lambda: [kernel.attend(query, k[0 if same else i], v[0 if same else i], None, None) for i in range(LAYERS)]

            calls = {"memory": (layers(shipped, False), args.threads), "cache": (layers(shipped, True), args.threads), "cache, 1 thread": (layers(shipped, True), 1)}
            want = shipped.attend(query, k[0], v[0], None, None)
            for name, kernel in others.items():
                if not torch.equal(kernel.attend(query, k[0], v[0], None, None), want):
                    print(f"  {name}: outputs differ from the shipped kernel's at T={t}, N={n}")
                calls[name] = (layers(kernel, False), args.threads)
            best = best_seconds(calls)
            torch.set_num_threads(args.threads)
            line = "  ".join(f"{name} {1e3 * s:.2f} ms ({s / floor:.2f}x)" for name, s in best.items())
            print(f"N={n} T={t:2d} tiles={shipped.tiles(torch.bfloat16, DIM, t, n)} floor {1e3 * floor:.2f} ms | {line}")


if __name__ == "__main__":
    main()
