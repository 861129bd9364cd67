"""The few-row linear kernel against other versions of it and against oneDNN's packed kernel, fp32, in one process.

For each row count, every ``nn.Linear`` of the embedded target (the 210 layer matrices and the LM head) takes a
random input of that many rows through the shipped ``csrc/linear_rows.cpp`` (``RowsKernel``), through each
``--source`` version built beside it, and through oneDNN's packed kernel (what ``PackedLinear`` runs for wider
products); the calls are alternated ``--repeats`` times and the best sum kept. Each version's outputs are
compared with the shipped kernel's over all the matrices, bit for bit.

    git show eb3bf99:specstack/csrc/linear_rows.cpp > /tmp/before.cpp   # docs/benchmarks.md, fp32 on AVX2
    python examples/linear_versions.py --rows 3 4 6 8 12 16 24 --source /tmp/before.cpp
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from specstack.models import load_target
from specstack.native import load
from specstack.packed_linear import RowsKernel, load_rows_kernel


def built(source: Path) -> RowsKernel:
    """The fp32 entry of another version of ``linear_rows.cpp``, built beside the shipped one."""
    argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    loaded = load(source, "specstack_linear_rows_f32", argtypes)
    if loaded is None:
        raise SystemExit(f"{source} did not build here")
    return RowsKernel(library=loaded[0], path=loaded[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--source", type=Path, nargs="*", default=[], help="other versions of linear_rows.cpp to time beside the shipped one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shipped = load_rows_kernel()
    if shipped is None:
        raise SystemExit("the few-row linear kernel did not build here")
    kernels = {"shipped": shipped, **{str(path): built(path) for path in args.source}}
    layers = [m for m in load_target(dtype=torch.float32)[0].module.modules() if isinstance(m, torch.nn.Linear)]
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        packed = [layer._packed_weight() for layer in layers]  # oneDNN's blocked copies, made once
        for n in args.rows:
            inputs = [torch.randn(n, layer.in_features, generator=generator) for layer in layers]  # [n, in] each
            want = [shipped(x, layer.weight, layer.bias) for layer, x in zip(layers, inputs)]
            for name, kernel in kernels.items():
                if any(not torch.equal(kernel(x, layer.weight, layer.bias), y) for layer, x, y in zip(layers, inputs, want)):
                    print(f"  {name}: outputs differ from the shipped kernel's at {n} rows")
            calls = {name: (lambda k=kernel: [k(x, layer.weight, layer.bias) for layer, x in zip(layers, inputs)]) for name, kernel in kernels.items()}
            calls["oneDNN packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, w, layer.bias, "none", [], "")
                                              for layer, x, w in zip(layers, inputs, packed)]
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(args.repeats):
                for name, call in calls.items():
                    began = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - began)
            print(f"rows {n:2d} | " + "  ".join(f"{name} {1e3 * s:.1f} ms" for name, s in best.items()))


if __name__ == "__main__":
    main()
