"""Each layer one compiled call (specstack.compiled_layers) against the lean decoder's Python, fp32.

Both settings in one process, alternated, best of three medians of seven: whole forwards of the embedded
target (reading its GGUF blocks) over each cache length, and of the default draft over its StreamingLLM
window, for T tokens. The two give the same bits (tests/test_compiled_layers.py); this measures the time.

    python examples/compiled_layers.py --threads 2 --caches 512 7500 --tokens 1 2 4 8 16
"""

from __future__ import annotations

import argparse

import torch

from specstack.bench.floor import fill, time_forward
from specstack.models import load_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 7500])
    parser.add_argument("--draft-window", type=int, default=256, help="slots of the draft's StreamingLLM cache")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, _ = load_default()
    generator = torch.Generator().manual_seed(0)
    levels = [("target", target, cached, False) for cached in args.caches] + [("draft", draft, args.draft_window, True)]
    for name, model, cached, relative in levels:
        compiled = model.decoder.compiled
        if compiled is None:
            raise SystemExit("the compiled layers cannot be built here (no C++ compiler)")
        store = model.new_cache(cached + max(args.tokens), relative_positions=relative)
        fill(store, cached, generator)
        for t in args.tokens:
            best = {}
            for _ in range(3):
                for setting, layers in (("python", None), ("compiled", compiled)):
                    model.decoder.compiled = layers
                    seconds = time_forward(model, store, cached=cached, tokens=t, tree=False, repeats=7, generator=generator)
                    best[setting] = min(best.get(setting, float("inf")), seconds)
            model.decoder.compiled = compiled
            print(f"{name} forward of {t} over {cached} cached: lean decoder's Python {1e3 * best['python']:.2f} ms, "
                  f"compiled layers {1e3 * best['compiled']:.2f} ms, {best['python'] / best['compiled']:.2f}x", flush=True)
        del store


if __name__ == "__main__":
    main()
