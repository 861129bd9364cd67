"""bf16 forwards on a CPU without bf16 dot products (AVX2): widened in the kernels, against torch's bf16 and fp32.

On such a CPU oneDNN has no bf16 kernels and ``F.linear`` emulates bf16 products. The few-row kernel
(csrc/linear_rows.cpp) instead widens bf16 rows and weights (or the Q4_1 blocks that stand for them) to
fp32, sums as in fp32 and rounds each output once; the compiled layers (specstack/compiled_layers.py)
then take bf16 forwards too. In one process, alternated, best of three medians of seven, whole forwards of
the embedded target over each cache length for T tokens:

* ``torch bf16``: bf16 rows through ``F.linear``, the lean decoder's Python (what bf16 ran before);
* ``widened``: bf16 rows through the kernel, the lean decoder's Python;
* ``+ compiled``: and each layer one compiled call (the shipped path);
* ``fp32``: the fp32 target (its shipped path), for reference.

    python examples/bf16_widened.py --threads 2 --caches 512 7500 --tokens 1 2 4
    python examples/bf16_widened.py --threads 2 --context 32768 --caches 32000 --tokens 1 2 4
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from specstack.bench.floor import fill, time_forward
from specstack.models import load_target
from specstack.packed_linear import RowsKernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 7500])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--context", type=int, default=None, help="the target's window (YaRN-scaled)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    window = {"context": args.context, "rope_scaling": "yarn"} if args.context else {}
    wide, narrow = load_target(dtype=torch.float32, **window)[0], load_target(dtype=torch.bfloat16, **window)[0]
    compiled = narrow.decoder.compiled
    if compiled is None or narrow.decoder.layers[0].o_proj._rows is None:
        raise SystemExit("the kernels cannot be built here (no C++ compiler)")
    if narrow.decoder.layers[0].o_proj._rows.bf16_dots:
        print("note: this CPU has AVX-512's bf16 dot products; bf16 rows take them, not widening")
    max_rows = RowsKernel.max_rows
    torch_bf16 = mock.patch.object(RowsKernel, "max_rows", lambda self, dtype: 0 if dtype == torch.bfloat16 else max_rows(self, dtype))
    generator = torch.Generator().manual_seed(0)
    for cached in args.caches:
        stores = {model: model.new_cache(cached + max(args.tokens)) for model in (wide, narrow)}
        for store in stores.values():
            fill(store, cached, generator)
        for t in args.tokens:
            best: dict[str, float] = {}
            for _ in range(3):
                for setting, model, layers, patch in (("torch bf16", narrow, None, torch_bf16), ("widened", narrow, None, None),
                                                      ("+ compiled", narrow, compiled, None), ("fp32", wide, wide.decoder.compiled, None)):
                    model.decoder.compiled = layers
                    with patch or mock.patch.object(RowsKernel, "max_rows", max_rows):
                        seconds = time_forward(model, stores[model], cached=cached, tokens=t, tree=False, repeats=7, generator=generator)
                    best[setting] = min(best.get(setting, float("inf")), seconds)
            narrow.decoder.compiled = compiled
            times = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in best.items())
            print(f"forward of {t} over {cached} cached: {times}; + compiled against torch bf16 {best['torch bf16'] / best['+ compiled']:.2f}x, "
                  f"against fp32 {best['fp32'] / best['+ compiled']:.2f}x", flush=True)
        del stores


if __name__ == "__main__":
    main()
