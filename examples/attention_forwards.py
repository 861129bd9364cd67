"""Whole target forwards with two versions of the decode-attention kernel, in one process.

Two copies of the embedded target (YaRN-scaled to 32K) are loaded: one with the kernel built from
``--source`` (another version of ``csrc/decode_attention.cpp``, in a folder beside the shared headers),
one with the shipped kernel. Each forward of T tokens over a cache of N random slots is timed on both,
alternated, best of four medians of three.

    mkdir -p /tmp/before && cp specstack/csrc/*.h /tmp/before/
    git show d8dea8a:specstack/csrc/decode_attention.cpp > /tmp/before/decode_attention.cpp
    python examples/attention_forwards.py --dtype float32 --source /tmp/before/decode_attention.cpp
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specstack import decode_attention
from specstack.bench.floor import fill, time_forward
from specstack.models import load_target


def load_with(source: Path, dtype: torch.dtype):
    """The target with the kernel built from ``source``."""
    shipped = decode_attention.SOURCE
    decode_attention.SOURCE = source
    try:
        target, _ = load_target(dtype=dtype, context=32768, rope_scaling="yarn")
    finally:
        decode_attention.SOURCE = shipped
    if target.attention_kernel is None:
        raise SystemExit(f"{source} did not build here")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the other version of decode_attention.cpp")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--caches", type=int, nargs="+", default=[7500, 32000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    targets = {"other": load_with(args.source, dtype), "shipped": load_with(decode_attention.SOURCE, dtype)}
    for cached in args.caches:
        stores = {}
        for name, target in targets.items():
            stores[name] = target.new_cache(cached + max(args.tokens))
            fill(stores[name], cached, torch.Generator().manual_seed(0))
        for t in args.tokens:
            best = dict.fromkeys(targets, float("inf"))
            for rep in range(4):
                for name, target in targets.items():
                    seconds = time_forward(target, stores[name], cached=cached, tokens=t, tree=False, repeats=3, generator=torch.Generator().manual_seed(rep))
                    best[name] = min(best[name], seconds)
            print(f"{args.dtype} {t} token(s) over {cached} slots: other {1e3 * best['other']:.1f} ms, shipped {1e3 * best['shipped']:.1f} ms "
                  f"({best['other'] / best['shipped']:.2f}x)", flush=True)
        del stores


if __name__ == "__main__":
    main()
