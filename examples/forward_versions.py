"""Whole target forwards (bf16, or ``--dtype float32``) through another version of the C++ kernels against this checkout's, in one process.

The embedded target's few-row linear kernel (``csrc/linear_rows.cpp``) and decode-attention kernel
(``csrc/decode_attention.cpp``) are switched between the versions built from ``--source DIR`` (a directory holding
both files and the headers they include) and this checkout's; the logits of a forward of each width must be the
same bits under both (the versions may differ only in speed), then forwards of each width over ``--cache`` random
cached slots are timed in alternating turns (both orders) and the medians compared.

    mkdir -p /tmp/before && for f in decode_attention.cpp linear_rows.cpp bf16.h amx_tiles.h scratch.h; do
        git show HEAD~1:specstack/csrc/$f > /tmp/before/$f; done
    python examples/forward_versions.py --source /tmp/before --cache 7500 --tokens 1 2 4 8 16
    python examples/forward_versions.py --source /tmp/before --cache 32000 --tokens 1 8 --context 32768

A version that sums in another order (``--other-order``) gives other bits: the largest logit difference at each width
is printed instead of stopping. ``--dot-products`` takes as the other version this checkout's kernels with the bf16
dot products turned on (where they were built; specstack.bf16_products chooses at load), which sum in another order:

    python examples/forward_versions.py --dot-products --cache 7500 --tokens 1 2 4 8 16

``--tree`` times token trees of each width (the last committed token and a binary tree under it) instead of chains.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import attrs
import torch

from specstack.bench.floor import batch_maker, fill, time_forward
from specstack.decode_attention import load_decode_kernel
from specstack.models import load_target
from specstack.packed_linear import PackedLinear, load_rows_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="a directory with the other linear_rows.cpp and decode_attention.cpp")
    parser.add_argument("--dot-products", action="store_true", help="the other version: these kernels with bf16 dot products on")
    parser.add_argument("--cache", type=int, default=7500)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=None, help="the target's window (YaRN beyond 8,192)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--other-order", action="store_true", help="the versions sum in different orders: report logit differences")
    parser.add_argument("--tree", action="store_true", help="time token trees (the committed token and a binary tree) instead of chains")
    args = parser.parse_args()
    if (args.source is not None) == args.dot_products:
        parser.error("give one of --source DIR and --dot-products")
    torch.set_num_threads(args.threads)
    scaled = {"context": args.context, "rope_scaling": "yarn" if args.context else None}
    model = load_target(dtype=getattr(torch, args.dtype), **scaled)[0]
    linears = [m for m in model.module.modules() if isinstance(m, PackedLinear)]
    linears += [product.linear for product in model.decoder.products()]
    kernels = {"this": (load_rows_kernel(), load_decode_kernel())}
    if args.dot_products:
        rows, attention = kernels["this"]
        if rows is None or attention is None or not (rows.bf16_dots_built and attention.dot_products_built):
            raise SystemExit("the kernels were not built with bf16 dot products here")
        kernels["other"] = (attrs.evolve(rows, bf16_dots=True), attrs.evolve(attention, dot_products=True))
        args.other_order = True
    else:
        kernels["other"] = (load_rows_kernel(source=args.source / "linear_rows.cpp"), load_decode_kernel(source=args.source / "decode_attention.cpp"))
    if any(kernel is None for pair in kernels.values() for kernel in pair):
        raise SystemExit("a kernel did not build here")

    def use(name: str) -> None:
        rows, attention = kernels[name]
        for m in linears:
            m._rows = rows
        model.attention_kernel = attention  # the compiled layers make their plans again from these kernels

    generator = torch.Generator().manual_seed(0)
    store = model.new_cache(args.cache + max(args.tokens))
    fill(store, args.cache, generator)
    with torch.no_grad():
        for t in args.tokens:
            make = batch_maker(model.vocab_size, args.cache, t, args.tree and t >= 2, generator)
            logits = {}
            for name in kernels:
                use(name)
                logits[name] = model.forward(make(), store).clone()  # [t, V]
                store.truncate(args.cache)
            if args.other_order:
                print(f"{t} tokens: largest logit difference {float((logits['other'].float() - logits['this'].float()).abs().max()):.4g}", flush=True)
            elif not torch.equal(logits["other"], logits["this"]):
                raise SystemExit(f"the two versions' logits differ at {t} tokens")
        if not args.other_order:
            print("the same logits at every width", flush=True)
        for t in args.tokens:
            times = {name: [] for name in kernels}
            for turn in range(args.turns):
                for name in kernels if turn % 2 == 0 else reversed(list(kernels)):
                    use(name)
                    times[name].append(time_forward(model, store, cached=args.cache, tokens=t, tree=args.tree and t >= 2, repeats=3, generator=generator))
            other, this = statistics.median(times["other"]), statistics.median(times["this"])
            print(f"{t} tokens over {args.cache} slots: other {1e3 * other:.2f} ms, this {1e3 * this:.2f} ms, {other / this:.3f}x", flush=True)


if __name__ == "__main__":
    main()
