"""The target reading its weights as the GGUF's blocks (Q4_1 layers; in fp32 the Q8_0 LM head too), against reading its own (bf16 or fp32).

Both settings in one process, alternated, best of three: the layers' 120 products (q/k/v and gate/up
fused, o, down) of 1-6 rows (from five on AMX tiles where there are tiles), then whole target forwards of T tokens over each cache length.
specstack.gguf_weights gives the same bits either way; this measures the time.

    python examples/q4_weights.py --threads 2 --caches 512 2048 7500
    python examples/q4_weights.py --threads 2 --caches 32000 --context 32768
    python examples/q4_weights.py --threads 2 --dtype float32 --tokens 1 2 3 4 6 8 16
"""

from __future__ import annotations

import argparse
import time

import torch

from specstack.bench.floor import fill, time_forward
from specstack.models import load_target
from specstack.packed_linear import PackedLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 2048, 7500])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--context", type=int, default=None, help="the target's window (YaRN beyond 8,192)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, name = getattr(torch, args.dtype), "bf16" if args.dtype == "bfloat16" else "fp32"
    target = load_target(dtype=dtype, context=args.context, rope_scaling="yarn" if args.context else None)[0]
    products = []
    for layer in target.decoder.layers:
        products += [layer.qkv.linear, layer.layer.self_attn.o_proj, layer.gate_up.linear, layer.layer.mlp.down_proj]
    fused = [layer.qkv.linear for layer in target.decoder.layers] + [layer.gate_up.linear for layer in target.decoder.layers]
    own = [m for m in target.module.modules() if isinstance(m, PackedLinear)]
    every = own + fused
    blocks = {id(m): m._blocks for m in every}
    print(f"GGUF blocks: {sum(m._blocks is not None for m in own)} of the module's {len(own)} linears (the LM head is the 211th), "
          f"{sum(m._blocks is not None for m in fused)} of the decoder's {len(fused)} fused products")

    def read_blocks(on: bool) -> None:
        for m in every:
            m._blocks = blocks[id(m)] if on else None

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in args.tokens:
            xs = [torch.randn(n, m.weight.shape[1], generator=generator).to(dtype) for m in products]  # [n, in] each
            best = {False: float("inf"), True: float("inf")}
            for _ in range(3):
                for on in (False, True):
                    read_blocks(on)
                    for m, x in zip(products, xs):
                        m(x)
                    began = time.perf_counter()
                    for _ in range(5):
                        for m, x in zip(products, xs):
                            m(x)
                    best[on] = min(best[on], (time.perf_counter() - began) / 5)
            print(f"{len(products)} products, {n} rows: {name} weights {1e3 * best[False]:.2f} ms, GGUF blocks {1e3 * best[True]:.2f} ms, "
                  f"{best[False] / best[True]:.2f}x")
    for cached in args.caches:
        store = target.new_cache(cached + max(args.tokens))
        fill(store, cached, generator)
        for t in args.tokens:
            best = {False: float("inf"), True: float("inf")}
            for _ in range(3):
                for on in (False, True):
                    read_blocks(on)
                    best[on] = min(best[on], time_forward(target, store, cached=cached, tokens=t, tree=False, repeats=7, generator=generator))
            print(f"forward of {t} over {cached} cached: {name} weights {1e3 * best[False]:.2f} ms, GGUF blocks {1e3 * best[True]:.2f} ms, "
                  f"{best[False] / best[True]:.2f}x")
        del store
    read_blocks(True)


if __name__ == "__main__":
    main()
