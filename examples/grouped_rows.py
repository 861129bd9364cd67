"""Weight rows stored four at a time, against the previous kernel reading rows stored one after another.

In one process: the embedded model's ``PackedLinear``s are switched between this checkout's few-row kernel over
grouped stored rows (specstack.weight_formats) and a previous ``linear_rows.cpp`` (``--previous``, from a checkout
before 2026-11-27) over the same blocks laid out row after row (codes, then the row's scales), in alternating turns
(both orders), and whole forwards of T tokens are timed over each cache length (medians). Also the LM head alone.
Both give the same bits; this measures the time (docs/benchmarks.md, "Weight rows stored four at a time").

    git worktree add /tmp/before 4e043c9
    python examples/grouped_rows.py --previous /tmp/before/specstack/csrc/linear_rows.cpp --dtype bfloat16 --caches 512 7500
    python examples/grouped_rows.py --previous /tmp/before/specstack/csrc/linear_rows.cpp --model draft --caches 272
    python examples/grouped_rows.py --previous /tmp/before/specstack/csrc/linear_rows.cpp --context 32768 --caches 32000
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specstack.bench.floor import fill, time_forward
from specstack.models import load_default, load_target
from specstack.packed_linear import PackedLinear, load_rows_kernel
from specstack.weight_formats import blocks_of


def row_after_row(stored: torch.Tensor, format) -> torch.Tensor:
    """Grouped stored rows -> the previous layout: each row's codes, then its blocks' scales."""
    blocks = blocks_of(stored, format.block_bytes)  # [out, in / 32, block_bytes]
    out, codes = blocks.shape[0], {"q4_1": 16, "q8_0": 32}.get(format.name, format.block_bytes)
    return torch.cat([blocks[..., :codes].reshape(out, -1), blocks[..., codes:].reshape(out, -1)], dim=1).contiguous()  # [out, in / 32 * block_bytes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", type=Path, required=True, help="a previous checkout's specstack/csrc/linear_rows.cpp")
    parser.add_argument("--model", choices=["target", "draft"], default="target")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 7500])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=None, help="the target's window (YaRN beyond 8,192)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    scaled = {"context": args.context, "rope_scaling": "yarn" if args.context else None}
    model = load_target(dtype=dtype, **scaled)[0] if args.model == "target" else load_default(dtype=dtype, **scaled)[1]
    linears = [m for m in model.module.modules() if isinstance(m, PackedLinear)]
    linears += [product.linear for product in model.decoder.products()]
    kernels = {"grouped": load_rows_kernel(), "row after row": load_rows_kernel(source=args.previous)}
    stored = {id(m): {"grouped": m._blocks, "row after row": None if m._blocks is None else row_after_row(m._blocks, m._format)} for m in linears}
    print(f"{sum(m._blocks is not None for m in linears)} of {len(linears)} products read stored rows")

    def use(name: str) -> None:
        for m in linears:
            m._rows, m._blocks = kernels[name], stored[id(m)][name]  # the compiled layers make their plans again from these

    def compare(label: str, run) -> None:
        times = {name: [] for name in kernels}
        for turn in range(args.turns):
            for name in kernels if turn % 2 == 0 else reversed(list(kernels)):
                use(name)
                times[name].append(run())
        before, after = statistics.median(times["row after row"]), statistics.median(times["grouped"])
        print(f"{label}: row after row {1e3 * before:.2f} ms, grouped {1e3 * after:.2f} ms, {before / after:.2f}x", flush=True)

    head = model.module.lm_head
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (1, 2, 3):
            x = torch.randn(n, head.weight.shape[1], generator=generator).to(dtype)  # [n, d]

            def run_head() -> float:
                head(x)
                began = time.perf_counter()
                for _ in range(10):
                    head(x)
                return (time.perf_counter() - began) / 10

            compare(f"LM head, {n} rows", run_head)
    for cached in args.caches:
        store = model.new_cache(cached + max(args.tokens), relative_positions=args.model == "draft")
        fill(store, cached, generator)
        for t in args.tokens:
            compare(f"{args.model} forward of {t} over {cached} slots",
                    lambda: time_forward(model, store, cached=cached, tokens=t, tree=False, repeats=5, generator=generator))
        del store
    use("grouped")


if __name__ == "__main__":
    main()
