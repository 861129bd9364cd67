"""bf16 products of TILES_FROM to 32 rows on AMX tiles, against the same products without them (the streaming
kernel up to six rows, oneDNN's packed product beyond).

Both settings in one process, alternated, on the embedded target with its Q4_1 blocks: the layers' 120
products (q/k/v and gate/up fused, o, down) of N rows, each run after reading 300 MB elsewhere (so the
weights come from memory, as in a forward over a long cache), median of seven; then whole target forwards
of T tokens over each cache length, best of three medians.

    python examples/tile_products.py --threads 2 --caches 512 7500
    python examples/tile_products.py --threads 2 --rows 3 4 --tokens 3 4 --tiles-from 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch

from specstack.bench.floor import fill, time_forward
from specstack.models import load_target
from specstack import packed_linear
from specstack.packed_linear import PackedLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 6, 8, 16, 32])
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 7500])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 5, 6, 8, 16, 32])
    parser.add_argument("--tiles-from", type=int, default=packed_linear.TILES_FROM,
                        help=f"the fewest rows that take the tiles (default: the shipped {packed_linear.TILES_FROM})")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(dtype=torch.bfloat16)[0]
    products = []
    for layer in target.decoder.layers:
        products += [layer.qkv.linear, layer.layer.self_attn.o_proj, layer.gate_up.linear, layer.layer.mlp.down_proj]
    fused = [product.linear for product in target.decoder.products()]
    every = [m for m in target.module.modules() if isinstance(m, PackedLinear)] + fused
    kernel = products[0]._rows
    if kernel is None or not kernel.tiles:
        raise SystemExit("no AMX tiles here: nothing to compare")
    kernels = {"without tiles": attrs.evolve(kernel, tiles=False), "tiles": attrs.evolve(kernel, tiles_from=args.tiles_from)}

    def use(name: str) -> None:
        for m in every:
            m._rows = kernels[name]  # the compiled layers make their plans again from it

    elsewhere = torch.ones(300 * 2**20 // 4)  # [75M] float32
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in args.rows:
            xs = [torch.randn(n, m.weight.shape[1], generator=generator).to(torch.bfloat16) for m in products]  # [n, in] each
            times = {name: [] for name in kernels}
            for _ in range(7):
                for name in kernels:
                    use(name)
                    elsewhere.add_(1)
                    began = time.perf_counter()
                    for m, x in zip(products, xs):
                        m(x)
                    times[name].append(time.perf_counter() - began)
            off, on = (statistics.median(times[name]) for name in kernels)
            print(f"{len(products)} products, {n} rows: without tiles {1e3 * off:.2f} ms, tiles {1e3 * on:.2f} ms, {off / on:.2f}x", flush=True)
    for cached in args.caches:
        store = target.new_cache(cached + max(args.tokens))
        fill(store, cached, generator)
        for t in args.tokens:
            best = {name: float("inf") for name in kernels}
            for _ in range(3):
                for name in kernels:
                    use(name)
                    best[name] = min(best[name], time_forward(target, store, cached=cached, tokens=t, tree=False, repeats=5, generator=generator))
            off, on = best.values()
            print(f"forward of {t} over {cached} cached: without tiles {1e3 * off:.2f} ms, tiles {1e3 * on:.2f} ms, {off / on:.2f}x", flush=True)
        del store


if __name__ == "__main__":
    main()
