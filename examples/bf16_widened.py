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

``--products`` times the target's 120 layer products at one row instead (``F.linear`` against the kernel),
``--attention`` the decode kernel against the split SDPA path for bf16 verifies of ``--tokens`` tokens (30
layers' random caches), ``--prefill`` one 2,048-token bf16 prefill chunk after 2,048 cached with wide
products through ``F.linear`` or widened over oneDNN's fp32 kernel.

    python examples/bf16_widened.py --threads 2 --caches 512 7500 --tokens 1 2 4
    python examples/bf16_widened.py --threads 2 --context 32768 --caches 32000 --tokens 1 2 4
    python examples/bf16_widened.py --threads 2 --attention --caches 7500 32000 --tokens 4 5 8 16
    python examples/bf16_widened.py --threads 2 --products --prefill
"""

from __future__ import annotations

import argparse
import time
from typing import Callable
from unittest import mock

import torch

from specstack.batch import TokenBatch
from specstack.bench.floor import fill, time_forward
from specstack.decode_attention import load_decode_kernel
from specstack.hf import _split_attention
from specstack.models import load_target
from specstack.packed_linear import PackedLinear, RowsKernel

MAX_ROWS = RowsKernel.max_rows
TAKES = PackedLinear.__dict__["_takes"]  # the staticmethod itself, to put back
SHIPPED = mock.patch.object(RowsKernel, "max_rows", MAX_ROWS)  # a patch that changes nothing
TORCH_BF16_ROWS = mock.patch.object(RowsKernel, "max_rows", lambda self, dtype: 0 if dtype == torch.bfloat16 else MAX_ROWS(self, dtype))


def torch_bf16_wide(kernel: RowsKernel):
    """A patch sending bf16 products wider than ``kernel`` takes to ``F.linear`` (what they took before)."""
    most = kernel.max_rows(torch.bfloat16)
    return mock.patch.object(PackedLinear, "_takes", staticmethod(
        lambda x, w: TAKES.__func__(x, w) and (x.dtype != torch.bfloat16 or x.numel() // w.shape[1] <= most)))


def best_of(settings: dict[str, Callable[[], float]], rounds: int = 3) -> dict[str, float]:
    """Each setting's best seconds over ``rounds`` rounds, the settings alternated."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in settings.items():
            best[name] = min(best.get(name, float("inf")), run())
    return best


def timed(call: Callable[[], object], repeats: int = 2) -> float:
    """Seconds of one ``call``, the mean of ``repeats`` after one warm-up."""
    call()
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - began) / repeats


def forwards(args, wide, narrow, generator) -> None:
    compiled = narrow.decoder.compiled
    for cached in args.caches:
        stores = {model: model.new_cache(cached + max(args.tokens)) for model in (wide, narrow)}
        for store in stores.values():
            fill(store, cached, generator)
        for t in args.tokens:
            def run(model, layers, patch) -> Callable[[], float]:
                def go() -> float:
                    model.decoder.compiled = layers
                    with patch:
                        return time_forward(model, stores[model], cached=cached, tokens=t, tree=False, repeats=7, generator=generator)
                return go

            best = best_of({"torch bf16": run(narrow, None, TORCH_BF16_ROWS), "widened": run(narrow, None, SHIPPED),
                            "+ compiled": run(narrow, compiled, SHIPPED), "fp32": run(wide, wide.decoder.compiled, SHIPPED)})
            narrow.decoder.compiled = compiled
            times = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in best.items())
            print(f"forward of {t} over {cached} cached: {times}; + compiled against torch bf16 {best['torch bf16'] / best['+ compiled']:.2f}x, "
                  f"against fp32 {best['fp32'] / best['+ compiled']:.2f}x", flush=True)
        del stores


def products(narrow) -> None:
    linears = [fused.linear for layer in narrow.decoder.layers for fused in (layer.qkv, layer.gate_up)]
    linears += [m for layer in narrow.decoder.layers for m in (layer.o_proj, layer.down_proj)]
    rows = [torch.randn(1, linear.weight.shape[1]).bfloat16() for linear in linears]  # [1, in] each

    def run(patch) -> Callable[[], float]:
        def go() -> float:
            with patch, torch.inference_mode():
                return timed(lambda: [linear(x) for linear, x in zip(linears, rows)])
        return go

    best = best_of({"F.linear": run(TORCH_BF16_ROWS), "kernel": run(SHIPPED)}, rounds=5)
    print(f"the target's {len(linears)} layer products, one bf16 row: F.linear {1e3 * best['F.linear']:.2f} ms, "
          f"kernel {1e3 * best['kernel']:.2f} ms, {best['F.linear'] / best['kernel']:.2f}x", flush=True)


def attention(args, narrow) -> None:
    kernel = load_decode_kernel()
    first = narrow.module.model.layers[0].self_attn
    layers, hq, d = narrow.module.config.num_hidden_layers, narrow.module.config.num_attention_heads, first.head_dim
    hkv = narrow.module.config.num_key_value_heads
    for n in args.caches:
        keys = [torch.randn(1, hkv, n, d).bfloat16() for _ in range(layers)]  # [1, Hkv, n, D] each
        values = [torch.randn(1, hkv, n, d).bfloat16() for _ in range(layers)]
        for t in args.tokens:
            query = torch.randn(1, hq, t, d).bfloat16()  # [1, Hq, T, D]
            if not kernel.applies(query, keys[0], values[0]):
                print(f"{t} tokens over {n}: not the kernel's here")
                continue
            best = best_of({"kernel": lambda: timed(lambda: [kernel.attend(query, k, v, None, None) for k, v in zip(keys, values)]),
                            "split SDPA": lambda: timed(lambda: [_split_attention(query, k, v, None) for k, v in zip(keys, values)])})
            print(f"bf16 attention of {t} tokens over {n} keys, {layers} layers: kernel {1e3 * best['kernel']:.1f} ms, split SDPA "
                  f"{1e3 * best['split SDPA']:.1f} ms, {best['split SDPA'] / best['kernel']:.2f}x", flush=True)


def prefill(narrow) -> None:
    ids = (torch.arange(4096) * 7 % narrow.vocab_size).tolist()

    def run(patch) -> Callable[[], float]:
        def go() -> float:
            with patch:
                store = narrow.new_cache(4096)
                narrow.forward(TokenBatch.chain(ids[:2048], start=0, num_logits=1), store)
                began = time.perf_counter()
                narrow.forward(TokenBatch.chain(ids[2048:], start=2048, num_logits=1), store)
                return time.perf_counter() - began
        return go

    best = best_of({"F.linear": run(torch_bf16_wide(narrow.decoder.layers[0].o_proj._rows)), "widened oneDNN": run(SHIPPED)}, rounds=2)
    print(f"bf16 prefill chunk of 2,048 after 2,048: wide products through F.linear {best['F.linear']:.2f} s, widened over oneDNN's fp32 "
          f"kernel {best['widened oneDNN']:.2f} s, {best['F.linear'] / best['widened oneDNN']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 7500])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--context", type=int, default=None, help="the target's window (YaRN-scaled)")
    parser.add_argument("--products", action="store_true", help="the 120 layer products at one row, F.linear against the kernel")
    parser.add_argument("--attention", action="store_true", help="bf16 attention, the decode kernel against the split SDPA path")
    parser.add_argument("--prefill", action="store_true", help="one 2,048-token bf16 prefill chunk, wide products through F.linear or widened")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    window = {"context": args.context, "rope_scaling": "yarn"} if args.context else {}
    narrow = load_target(dtype=torch.bfloat16, **window)[0]
    if narrow.decoder.compiled is None or narrow.decoder.layers[0].o_proj._rows is None:
        raise SystemExit("the kernels cannot be built here (no C++ compiler)")
    if narrow.decoder.layers[0].o_proj._rows.bf16_dots:
        print("note: this CPU has AVX-512's bf16 dot products; bf16 rows take them, not widening")
    if args.products or args.attention or args.prefill:
        for asked, measure in ((args.products, lambda: products(narrow)), (args.attention, lambda: attention(args, narrow)), (args.prefill, lambda: prefill(narrow))):
            if asked:
                measure()
        return
    forwards(args, load_target(dtype=torch.float32, **window)[0], narrow, torch.Generator().manual_seed(0))


if __name__ == "__main__":
    main()
