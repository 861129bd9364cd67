"""Each layer one compiled call (specstack.compiled_layers) against the lean decoder's Python, fp32.

Both settings in one process, alternated, best of three medians of seven: whole forwards of the embedded
target (reading its GGUF blocks) over each cache length, and of the default draft over its StreamingLLM
window, for T tokens. The two give the same bits (tests/test_compiled_layers.py); this measures the time.
With ``--stacks``, each stack instead decodes ``--new-tokens`` tokens after a prompt of ``--prompt-tokens``
tokens of a book, prefilled once, both settings alternated three times (best ms per token), and says
whether both emitted the same tokens.

    python examples/compiled_layers.py --threads 2 --caches 512 7500 --tokens 1 2 4 8 16
    python examples/compiled_layers.py --threads 2 --stacks autoregressive triforce triforce-lookup prompt-lookup medusa-lookup --temperatures 0 0.6
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
    parser.add_argument("--stacks", nargs="+", default=None, help="decode with these registered stacks instead of timing forwards")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--prompt-tokens", type=int, default=7500)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--book", default="prideprejudice")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default()
    if args.stacks:
        decode(args, target, draft, tokenizer)
        return
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


def decode(args, target, draft, tokenizer) -> None:
    """Each stack's decoding with and without the compiled layers, alternated after one prefill."""
    from specstack.data import book_tokens
    from specstack.registry import Registry
    from specstack.sampling import SamplingConfig

    registry, prompt = Registry.create(), book_tokens(tokenizer, args.prompt_tokens, name=args.book)
    owned = [(model, model.decoder.compiled) for model in (target, draft)]
    for temperature in args.temperatures:
        for name in args.stacks:
            stack = registry.stack(name, target=target, draft=draft if registry.stack_recipe(name).needs_draft else None,
                                   sampling=SamplingConfig(temperature=temperature), seed=0)
            stack.generate(prompt, 8, seed=0)  # the prefill, kept by every run below
            best, tokens = {}, {}
            for _ in range(3):
                for setting in ("python", "compiled"):
                    for model, compiled in owned:
                        model.decoder.compiled = compiled if setting == "compiled" else None
                    result = stack.generate(prompt, args.new_tokens, seed=0, reuse_cache=True)
                    best[setting] = min(best.get(setting, float("inf")), result.seconds / len(result.tokens))
                    tokens[setting] = list(result.tokens)
            for model, compiled in owned:
                model.decoder.compiled = compiled
            print(f"T={temperature} {name}: lean decoder's Python {1e3 * best['python']:.1f} ms/token, compiled layers {1e3 * best['compiled']:.1f}, "
                  f"{best['python'] / best['compiled']:.2f}x, same tokens: {tokens['python'] == tokens['compiled']}", flush=True)


if __name__ == "__main__":
    main()
