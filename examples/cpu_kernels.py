"""The compiled CPU kernels on and off, in one process: the on/off tables of docs/benchmarks.md
("The decode-attention kernel", "A few rows: a streaming kernel").

Three settings of the same loaded models, alternated ``--rounds`` times (the best median is kept):
  * ``torch``: SDPA for attention, oneDNN's packed kernel for every linear (what ran before the kernels);
  * ``attention``: the decode-attention kernel (``specstack.decode_attention``);
  * ``both``: that and the few-row linear kernel (``specstack.packed_linear``), the shipped default.
In bf16 on a CPU with AMX tiles a fourth, ``widened``, is ``both`` with the attention kernel told not to
use the tiles or dot products (``attrs.evolve(kernel, amx=False, dot_products=False)``: up to four tokens widened, wider ones to SDPA).

Each row is one ``HFCausalLM.forward`` of T tokens (a chain, or with ``tree`` one committed token and a
binary tree) over a random cache, timed as ``specstack floor`` times it; ratios are ``torch`` ÷ setting,
and with ``widened`` also ``widened`` ÷ ``both`` (what the tiles buy).
In bf16 the linear kernel takes one to six rows where the CPU has AVX-512's bf16 dot products, one to
32 where it also has AMX tiles (elsewhere ``both`` equals ``attention``), and the attention kernel one
to four tokens (one to sixteen where the CPU has AMX tiles).

    python examples/cpu_kernels.py --threads 2
    python examples/cpu_kernels.py --threads 2 --dtype bfloat16 --caches 7500 1024
    python examples/cpu_kernels.py --threads 2 --dtype bfloat16 --context 32768 --caches 32000
"""

from __future__ import annotations

import argparse

import attrs
import torch

from specstack.bench.floor import WINDOW, fill, time_forward
from specstack.models import load_default
from specstack.packed_linear import PackedLinear, load_rows_kernel

FORWARDS = [(1, False), (2, False), (3, False), (4, False), (8, False), (16, False), (4, True), (8, True), (16, True)]


def use(model, setting: str, attention, rows) -> None:
    """Put ``model`` (an HFCausalLM) in one setting: which compiled kernels its forwards take."""
    model.attention_kernel = {"attention": attention, "both": attention, "widened": attrs.evolve(attention, amx=False, dot_products=False)}.get(setting)
    for module in model.module.modules():
        if isinstance(module, PackedLinear):
            PackedLinear.adopt(module, rows if setting in ("both", "widened") else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--caches", type=int, nargs="+", default=[7500, 1024], help="the target's cached slots")
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards per figure (median)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the settings (best median kept)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and KV cache")
    parser.add_argument("--context", type=int, default=None, help="the target's window (beyond its trained 8,192: YaRN-scaled)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, _ = load_default(dtype=getattr(torch, args.dtype), context=args.context, rope_scaling="yarn")  # yarn only beyond the trained window
    attention, rows = target.attention_kernel, load_rows_kernel()
    if attention is None or rows is None:
        raise SystemExit("the kernels cannot be built here (no C++ compiler?)")
    generator = torch.Generator(device="cpu").manual_seed(0)
    tiles = attention.amx and args.dtype == "bfloat16"
    settings = ("torch", "attention", "both", "widened") if tiles else ("torch", "attention", "both")
    print(f"{'model':<7} {'cache':>6} {'T':>3} {'shape':<5} " + " ".join(f"{s + ' ms':>13}" for s in settings)
          + "   torch ÷ attention, ÷ both" + (", widened ÷ both" if tiles else ""))
    for model, caches, relative in ((target, args.caches, False), (draft, [WINDOW], True)):
        for cached in caches:
            store = model.new_cache(cached + 16, relative_positions=relative)
            fill(store, cached, generator)
            for tokens, tree in FORWARDS:
                best = dict.fromkeys(settings, float("inf"))
                for _ in range(args.rounds):
                    for setting in settings:
                        use(model, setting, attention, rows)
                        seconds = time_forward(model, store, cached=cached, tokens=tokens, tree=tree, repeats=args.repeats, generator=generator)
                        best[setting] = min(best[setting], seconds)
                use(model, "both", attention, rows)
                name = "target" if model is target else "draft"
                print(f"{name:<7} {cached:>6} {tokens:>3} {'tree' if tree else 'chain':<5} "
                      + " ".join(f"{1e3 * best[s]:>13.2f}" for s in settings)
                      + f"   {best['torch'] / best['attention']:.2f}x, {best['torch'] / best['both']:.2f}x"
                      + (f", {best['widened'] / best['both']:.2f}x" if tiles else ""), flush=True)
            del store


if __name__ == "__main__":
    main()
